"""What one generation call gives back: its metrics, its result (tokens, text, beams), the streamed
token deltas with their log-probabilities, and the stream that carries them::

    stream = session.stream(prompt_ids, GenerationConfig(max_new_tokens=32))
    async for delta in stream:            # TokenDelta
        print(delta.text, end="")
    result = stream.result                # GenerationResult: .token_ids, .finish_reason, .metrics
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass(frozen=True)
class GenerationMetrics:
    """What one ``generate`` call cost and reused."""

    prompt_tokens: int
    """Length of the prompt passed in."""
    reused_tokens: int
    """Prompt tokens whose KV was already in the KV session (longest common prefix)."""
    prefix_cache_tokens: int
    """Prompt tokens whose KV was copied from the shared prefix cache."""
    restored_tokens: int
    """Prompt tokens whose KV came back from an offloaded snapshot."""
    prefilled_tokens: int
    """Prompt tokens actually run through the model before the first new token."""
    generated_tokens: int
    """New tokens returned."""
    ttft_s: float
    """Seconds from the call to the first new token (alignment + prefill + first sample)."""
    tpot_s: float
    """Mean seconds per output token after the first."""
    kv_tokens: int
    """Tokens in the KV session's KV when the call returned."""
    kv_bytes: int
    """Bytes the KV session's KV occupies in the model's cache precision."""
    kv_exact: bool = True
    """False when part of the KV came from a lossy restore (u8 state-API cache, a rounding snapshot)."""
    model_steps: int = 0
    """Model steps this call's prefill and decode ran in (0: the engine does not count them)."""
    mean_batch: float = 0.0
    """Sequences per step, on average (paged engine: >1 when others' tokens or own beams shared steps)."""
    queued_s: float = 0.0
    """Seconds this call's feeds waited for their step to begin (steps ahead, KV sessions of the last step)."""
    forced_tokens: int = 0
    """Generated tokens a grammar forced, taken without sampling (``GenerationConfig.fast_forward``)."""
    steps_saved: int = 0
    """Model steps saved against one per token: forced runs fed as one chunk, plus confirmed drafted tokens."""
    drafted_tokens: int = 0
    """Draft positions prompt-lookup fed for the model to check (a short lookup is padded)."""
    accepted_tokens: int = 0
    """Drafted tokens the model's own choice confirmed."""


@dataclass(frozen=True)
class BeamHypothesis:
    """One finished beam: its tokens and normalised score."""

    token_ids: tuple[int, ...]
    """The beam's generated ids, a stop token that finished it included (empty only with ``max_new_tokens=0``)."""
    score: float
    """Its summed log-probability (natural log) over ``len(token_ids) ** length_penalty``; higher is better."""


@dataclass(frozen=True)
class GenerationResult:
    """What ``KVSession.generate`` returns."""

    token_ids: tuple[int, ...]
    """Generated ids (stop token included if one ended generation)."""
    text: str
    """Decoded text (stop string cut)."""
    finish_reason: str
    """"stop" (EOS / stop token / stop string), "length" (max_new_tokens or the context's room) or "constraint"."""
    metrics: GenerationMetrics
    """What the call cost and reused: token counts, times in seconds, the KV it left."""
    beams: tuple[BeamHypothesis, ...] = ()
    """With num_beams>1: the best ``num_return_sequences`` hypotheses, best first."""


@dataclass(frozen=True)
class TopLogprob:
    """One likely token at a position: its id, its text alone, and its log-probability."""

    token_id: int
    """The token's id."""
    token: str
    """Its text alone (``tokenizer.decode([token_id])``)."""
    logprob: float
    """Its log-probability there (natural log, <= 0)."""


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability at its position, and the ``logprobs`` likeliest tokens there."""

    token_id: int
    """The generated token's id."""
    token: str
    """The token's text alone (``tokenizer.decode([token_id])``)."""
    logprob: float
    """Natural log, <= 0: the log-softmax of the raw logits (before penalties, masks, temperature, top-k/top-p)."""
    top: tuple[TopLogprob, ...] = ()
    """The ``logprobs`` likeliest tokens there, most likely first (ties: lower id), the generated one or not."""


@dataclass(frozen=True)
class TokenDelta:
    """One streamed step: the new token and the text it completes (may be empty); ``logprob``
    when ``GenerationConfig.logprobs`` asks for it (None on the tail of held-back text)."""

    token_id: int
    """The token's id (a stop token gets no delta); a tail delta carries the last one's (-1: none generated);
    beam search streams one delta with the winner's whole text."""
    text: str
    """The text it completes; "" while part of a UTF-8 character or of a possible stop string is held back."""
    logprob: TokenLogprob | None = None
    """With ``GenerationConfig.logprobs``: its log-probability and alternatives; else None, and on a tail delta."""


@dataclass
class GenerationStream:
    """Async iterator of ``TokenDelta``: ``stream = session.stream(ids, cfg); async for d in stream: print(d.text)``;
    use ``async with session.stream(...) as stream:`` when you may stop early."""

    _events: AsyncIterator[TokenDelta | GenerationResult]
    result: GenerationResult | None = field(default=None)
    """Set once iteration ends; None before, and after a stream stopped early (``aclose``) or failed."""

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[TokenDelta]:
        async for event in self._events:
            if isinstance(event, GenerationResult):
                self.result = event
            else:
                yield event

    async def aclose(self) -> None:
        """Stop early: the generation ends at the current step and the session is released."""
        close = getattr(self._events, "aclose", None)
        if close is not None:
            await close()

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def collect(self) -> GenerationResult:
        """Run to the end and return the result."""
        async for _ in self:
            continue  # drain: the result is set when the events end
        assert self.result is not None
        return self.result
