"""The decode loop of one generate call: choose a token, stream its text, stop, feed it back.

``decode_tokens`` is shared by every engine: the stateful engine chooses tokens by sampling
the model's logits, the scripted engine from its script. Each chosen token that does not
end generation is fed (and joins the session's log); the token that ends it is not fed —
the next turn's alignment feeds it if the rendered history contains it. Tokens a grammar forces
are taken without sampling and fed with the token before them as one chunk (``fast_forward``);
a call on a slot that returns several positions' logits feeds a guess of the next tokens with
them and keeps those the model chooses too, greedy or sampled (``prompt_lookup``). No OpenVINO here.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, aclosing
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio

from agentkv.engine.base import (
    BeamHypothesis,
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
    Tokenizer,
    TokenLogprob,
    TopLogprob,
)
from agentkv.engine.decode.alignment import Alignment
from agentkv.engine.decode.beam_decode import run_beam_search
from agentkv.engine.decode.detokenize import IncrementalDecoder
from agentkv.engine.decode.fast_forward import FastForwardCounts, ForcingConstraint, forced_source, next_forced
from agentkv.engine.decode.prompt_lookup import Drafts, PromptLookup
from agentkv.engine.decode.sampling import (
    StopStringMatcher,
    make_rng,
    sample_next,
    token_logprobs,
)
from agentkv.engine.decode.step_counts import StepCounts
from agentkv.kv.log import feeds_rows

if TYPE_CHECKING:
    import numpy as np

    from agentkv.kv.log import KVLog, KVSlot, RowsSlot


class DecodeBackend(Protocol):
    """What a decode loop reads of the backend its session works through (``SlotBackend``)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_context_len(self) -> int: ...
    def metrics_for(self, log: KVLog, align: Alignment, *, generated: int, ttft: float,
                    tpot: float) -> GenerationMetrics: ...
    def room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1,
             rewrite: bool = False) -> AbstractAsyncContextManager[None]: ...

RunBlocking = Callable[..., Awaitable[Any]]
"""``await run(fn, *args)``: a session's way to run a blocking step in a worker thread."""


@dataclass(frozen=True)
class DecodeOutcome:
    """How a decode loop ended."""

    generated: list[int]
    text: str
    finish_reason: str
    first_token_at: float | None


def step_counts(slot: object) -> StepCounts | None:
    """A copy of the slot's model-step counts, or None when its engine does not count steps."""
    counts = getattr(slot, "steps", None)
    return counts.copy() if isinstance(counts, StepCounts) else None


def with_steps(metrics: GenerationMetrics, slot: object, before: StepCounts | None) -> GenerationMetrics:
    """``metrics`` with the model steps ``slot`` ran in since ``before`` (unchanged without counts)."""
    now = step_counts(slot)
    if before is None or now is None:
        return metrics
    spent = now.since(before)
    return replace(metrics, model_steps=spent.steps, mean_batch=spent.mean_batch, queued_s=spent.queued_s)


def stop_ids_for(config: GenerationConfig, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Ids that end generation: the config's stop ids, plus EOS unless ``ignore_eos``."""
    return frozenset(config.stop_token_ids) | (frozenset() if config.ignore_eos else eos_token_ids)


async def decode_tokens(
    choose: Callable[[list[int]], int],
    feed: Callable[[list[int]], Awaitable[None]],
    *,
    config: GenerationConfig,
    decode_text: Callable[[Sequence[int]], str],
    stop_ids: frozenset[int],
    max_new: int,
    constraint: TokenConstraint | None,
    score: Callable[[int], TokenLogprob] | None = None,
    forcing: ForcingConstraint | None = None,
    counts: FastForwardCounts | None = None,
    on_forced: Callable[[], None] | None = None,
    drafts: Drafts | None = None,
) -> AsyncGenerator[TokenDelta | DecodeOutcome, None]:
    """Yield a ``TokenDelta`` per token (text never splits a UTF-8 character), then the outcome.

    ``choose(generated)`` picks the next id; ``feed(ids)`` runs ids through the model in one
    step; ``score(id)`` (when log-probabilities are asked for) reads the chosen id's
    log-probability from the same logits, before the feed. With ``forcing`` (the constraint, when
    it fast-forwards: ``fast_forward.forced_source``) a token it forces is taken without
    ``choose`` (``on_forced()`` then stands for the draw the sampler would have made), and
    accepted tokens are fed only when the model must choose again or the loop ends: a forced
    run goes in one feed with the token before it. ``counts`` adds up forced tokens and feeds.
    With ``drafts``, those feeds go through ``drafts.feed`` with a draft after them, ``choose``
    reads ``drafts.logits``, and a token the draft fed already is not fed again; however the loop
    ends (closed or cancelled too), the KV log then holds what one-by-one decoding's would.
    """
    decoder = IncrementalDecoder(decode_text)
    stopper = StopStringMatcher(list(config.stop_strings))
    counts = counts if counts is not None else FastForwardCounts()
    generated: list[int] = []
    pending: list[int] = []  # accepted tokens not fed yet
    held = 0  # generated tokens one-by-one decoding has in the KV or pending now
    pieces: list[str] = []
    first_at: float | None = None
    finish = "length"
    owner = _task_id()
    try:
        while len(generated) < max_new:
            token = next_forced(forcing)
            if token is None:
                if pending:
                    if drafts is not None:
                        await drafts.feed(pending, max_new - len(generated) - 1)
                    else:
                        await feed(pending)
                    counts.fed_in(len(pending))
                    pending = []
                token = choose(generated)
            else:
                counts.forced += 1
                if on_forced is not None:
                    on_forced()
            if first_at is None:
                first_at = time.perf_counter()
            generated.append(token)
            fed = drafts is not None and await drafts.accept(token)
            if constraint is not None:
                constraint.advance(token)
            if token in stop_ids:
                finish = "stop"
                break
            logprob = score(token) if score is not None else None
            text, stopped = stopper.feed(decoder.push(token))
            pieces.append(text)
            yield TokenDelta(token, text, logprob)
            if stopped:
                finish = "stop_string"
                break
            if constraint is not None and constraint.is_finished():
                finish = "constraint"
                break
            if len(generated) == max_new:
                break
            held += 1
            if fed:
                counts.confirmed += 1
            else:
                pending.append(token)
    finally:
        # NOTE: also when the consumer closes the stream or the task is cancelled with a draft
        # ahead: its unconfirmed tokens (and the last token) leave the KV log, shielded from the
        # cancellation. Skipped when another task runs this: an abandoned generator finalized
        # later, after its caller let the slot go (the next alignment trims the tail then).
        if drafts is not None and owner is not None and _task_id() == owner:
            with anyio.CancelScope(shield=True):
                await drafts.settle(held - len(pending))
    if pending:  # NOTE: the tokens before the one that ended generation, as one-by-one would have fed
        await feed(pending)
        counts.fed_in(len(pending))
    if finish == "stop_string":
        finish = "stop"
    else:
        tail, _ = stopper.feed(decoder.flush())
        tail += stopper.flush()
        if tail:
            pieces.append(tail)
            yield TokenDelta(generated[-1] if generated else -1, tail)
    yield DecodeOutcome(generated, "".join(pieces), finish, first_at)


def _task_id() -> int | None:
    """The running task's id; None outside one (a generator closed after its event loop)."""
    try:
        return anyio.get_current_task().id
    except RuntimeError:
        return None


def timing(started: float, first_at: float | None, generated: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from the call's start and its first token's time."""
    now = time.perf_counter()
    first = first_at if first_at is not None else now
    tpot = (now - first) / (generated - 1) if generated > 1 else 0.0
    return first - started, tpot


class DecodeLoop:
    """One generation on an aligned KV log (its last logits follow the prompt); ``run()``
    yields deltas, then the result. ``run_blocking`` runs each model step in a worker thread."""

    def __init__(
        self,
        engine: DecodeBackend,
        log: KVLog,
        slot: KVSlot,
        run_blocking: RunBlocking,
        prompt: list[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None,
        align: Alignment,
        started: float,
        steps_before: StepCounts | None = None,
    ) -> None:
        """``steps_before``: the slot's step counts before the call's alignment (the metrics
        then count the prefill's steps too; default: from now)."""
        self.engine, self.log, self.slot, self.run_blocking = engine, log, slot, run_blocking
        self.steps_before = steps_before if steps_before is not None else step_counts(slot)
        self.prompt = prompt
        self.config, self.constraint = config, constraint
        self.align, self.started = align, started
        self.metrics: GenerationMetrics | None = None
        self.stop_ids = stop_ids_for(config, self.engine.eos_token_ids)
        self.max_new = max(0, min(config.max_new_tokens, self.engine.max_context_len - len(prompt)))
        self.fast_forward = FastForwardCounts()
        self._rng: np.random.Generator | None = None
        self.drafts: Drafts | None = None

    async def run(self) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Yield a ``TokenDelta`` per token, then the ``GenerationResult``."""
        if self.config.num_beams > 1:
            result = await run_beam_search(self)
            yield TokenDelta(result.token_ids[-1] if result.token_ids else -1, result.text)
            yield result
            return
        async with aclosing(self.run_sequential()) as events:  # closing run() settles a draft at once
            async for event in events:
                yield event

    async def run_sequential(self) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Tokens from ``chooser()``, or forced by the constraint: a delta per token, then the result."""
        log = self.log

        async def feed(tokens: list[int]) -> None:
            async with self.engine.room(self.slot, len(tokens)):
                await self.run_blocking(log.feed, self.slot, tokens)

        self.drafts = self.make_drafts(feed)
        events = decode_tokens(
            self.chooser(), feed, config=self.config, decode_text=self.engine.tokenizer.decode,
            stop_ids=self.stop_ids, max_new=self.max_new, constraint=self.constraint, score=self.scorer(),
            forcing=self.forcing(), counts=self.fast_forward, on_forced=self.skip_draw, drafts=self.drafts,
        )
        async with aclosing(events):
            async for event in events:
                if isinstance(event, DecodeOutcome):
                    yield self.finish(event.generated, event.text, event.finish_reason, event.first_token_at)
                else:
                    yield event

    def chooser(self) -> Callable[[list[int]], int]:
        """``choose(generated)``: the next token, sampled from the log's last logits under the
        config (and the constraint's mask)."""
        log, cfg = self.log, self.config
        rng = self._rng = make_rng(cfg.seed)

        def choose(generated: list[int]) -> int:
            # NOTE: while a draft is ahead, log.tokens holds drafted tokens too; the penalties'
            # token set is the same (a draft is copied from the prompt and the generated tokens).
            # A sampled draw from a verify row is the speculative rule (``prompt_lookup.Drafts``).
            logits = self.drafts.logits if self.drafts is not None else None
            logits = logits if logits is not None else log.last_logits
            assert logits is not None
            allowed = self.constraint.allowed_mask() if self.constraint is not None else None
            return sample_next(logits, cfg, rng, context_ids=log.tokens, generated_ids=generated, allowed=allowed)

        return choose

    def forcing(self) -> ForcingConstraint | None:
        """The constraint to take forced tokens from (``fast_forward.forced_source``), or None."""
        if type(self).chooser is not DecodeLoop.chooser:
            # NOTE: a loop that chooses tokens itself (the scripted engine replays its script)
            # must be asked for every token, forced or not.
            return None
        return forced_source(self.constraint, self.config)

    def make_drafts(self, feed: Callable[[list[int]], Awaitable[None]]) -> Drafts | None:
        """Prompt-lookup drafts for this call (``decode/prompt_lookup.py``), or None: off unless the
        config asks for them without log-probabilities or beams (greedy or sampled), the slot
        returns several positions' logits (paged), and the loop chooses by the logits (not a script)."""
        cfg = self.config
        if not (cfg.prompt_lookup and cfg.logprobs is None and cfg.num_beams == 1) \
                or not feeds_rows(self.slot) or type(self).chooser is not DecodeLoop.chooser:
            return None
        log, slot = self.log, cast("RowsSlot", self.slot)

        async def feed_rows(tokens: list[int], rows: int) -> np.ndarray:
            async with self.engine.room(slot, len(tokens)):
                logits: np.ndarray = await self.run_blocking(log.feed_rows, slot, tokens, rows)
                return logits

        async def trim(n: int) -> None:
            await self.run_blocking(log.trim, slot, len(log) - n)

        cap = getattr(slot, "draft_cap", None)
        return Drafts(PromptLookup(log.tokens), feed, feed_rows, trim, cap=cap if callable(cap) else None)

    def skip_draw(self) -> None:
        """Stand for the draw sampling would have made for a forced token (its mask allowed only
        it): a seeded sampled call then draws the same tokens with fast-forward on or off."""
        if self._rng is not None and not self.config.greedy:
            self._rng.random()

    def scorer(self) -> Callable[[int], TokenLogprob] | None:
        """``score(token)``: the token's log-probability and the config's number of alternatives,
        from the log's last logits (``sampling.token_logprobs``); None when not asked for."""
        top = self.config.logprobs
        if top is None:
            return None
        log, decode = self.log, self.engine.tokenizer.decode

        def score(token: int) -> TokenLogprob:
            assert log.last_logits is not None
            logprob, ids, values = token_logprobs(log.last_logits, token, top)
            alternatives = tuple(TopLogprob(int(i), decode([int(i)]), float(v)) for i, v in zip(ids, values))
            return TokenLogprob(token, decode([token]), logprob, alternatives)

        return score

    def finish(
        self,
        generated: list[int],
        text: str,
        finish: str,
        first_at: float | None,
        beams: tuple[BeamHypothesis, ...] = (),
    ) -> GenerationResult:
        """Build the result and the metrics."""
        ttft, tpot = timing(self.started, first_at, len(generated))
        self.metrics = replace(with_steps(
            self.engine.metrics_for(self.log, self.align, generated=len(generated), ttft=ttft, tpot=tpot),
            self.slot, self.steps_before), forced_tokens=self.fast_forward.forced,
            steps_saved=self.fast_forward.steps_saved, drafted_tokens=self.drafts.drafted if self.drafts else 0,
            accepted_tokens=self.drafts.accepted if self.drafts else 0)
        return GenerationResult(
            token_ids=tuple(generated), text=text, finish_reason=finish, metrics=self.metrics, beams=beams
        )
