"""The decode loop of one generate call: sample, stream, stop, feed back — and beam search.

Runs after the session has aligned its KV to the prompt (``_last_logits`` holds the logits
after the prompt's last token). Each sampled token that does not end generation is fed
through the model and joins the session's log; the token that ends it is not fed (the next
turn's alignment feeds it if the rendered history contains it).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from agentkv.engine.base import (
    BeamHypothesis,
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
)
from agentkv.engine.detokenize import IncrementalDecoder
from agentkv.engine.sampling import StopStringMatcher, make_rng, sample_next
from agentkv.engine.slot import Slot

if TYPE_CHECKING:
    from agentkv.engine.session import StatefulSession


class DecodeLoop:
    """One generation on an aligned session; ``run()`` yields deltas, then the result."""

    def __init__(
        self,
        session: StatefulSession,
        slot: Slot,
        prompt: list[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None,
        align: dict[str, int],
        started: float,
    ) -> None:
        self.session = session
        self.slot = slot
        self.prompt = prompt
        self.config = config
        self.constraint = constraint
        self.align = align
        self.started = started
        self.metrics: GenerationMetrics | None = None
        engine = session._engine
        self.engine = engine
        stops = set(config.stop_token_ids)
        if not config.ignore_eos:
            stops |= engine.eos_token_ids
        self.stop_ids = frozenset(stops)
        room = engine.max_context_len - len(prompt)
        self.max_new = max(0, min(config.max_new_tokens, room))

    async def run(self) -> AsyncIterator[TokenDelta | GenerationResult]:
        """Yield a ``TokenDelta`` per token, then the ``GenerationResult``."""
        if self.config.num_beams > 1:
            from agentkv.engine.beam_decode import run_beam_search

            result = await run_beam_search(self)
            yield TokenDelta(result.token_ids[-1] if result.token_ids else -1, result.text)
            yield result
            return
        async for event in self._sample_loop():
            yield event

    async def _sample_loop(self) -> AsyncIterator[TokenDelta | GenerationResult]:
        session, cfg = self.session, self.config
        rng = make_rng(cfg.seed)
        decoder = IncrementalDecoder(self.engine.tokenizer.decode)
        stopper = StopStringMatcher(list(cfg.stop_strings))
        generated: list[int] = []
        pieces: list[str] = []
        first_at: float | None = None
        finish = "length"
        logits = session._last_logits
        while len(generated) < self.max_new:
            assert logits is not None
            allowed = self.constraint.allowed_mask() if self.constraint is not None else None
            token = sample_next(
                logits, cfg, rng, context_ids=session._tokens, generated_ids=generated, allowed=allowed
            )
            if first_at is None:
                first_at = time.perf_counter()
            generated.append(token)
            if self.constraint is not None:
                self.constraint.advance(token)
            if token in self.stop_ids:
                finish = "stop"
                break
            text, stopped = stopper.feed(decoder.push(token))
            pieces.append(text)
            yield TokenDelta(token, text)
            if stopped:
                finish = "stop_string"
                break
            if self.constraint is not None and self.constraint.is_finished():
                finish = "constraint"
                break
            if len(generated) == self.max_new:
                break
            logits = await session._run(session._feed_blocking, self.slot, [token])
        if finish == "stop_string":
            finish = "stop"
        else:
            tail, _ = stopper.feed(decoder.flush())
            tail += stopper.flush()
            if tail:
                pieces.append(tail)
                yield TokenDelta(generated[-1] if generated else -1, tail)
        yield self.finish(generated, "".join(pieces), finish, first_at)

    def finish(
        self,
        generated: list[int],
        text: str,
        finish: str,
        first_at: float | None,
        beams: tuple[BeamHypothesis, ...] = (),
    ) -> GenerationResult:
        """Build the result and the metrics."""
        now = time.perf_counter()
        first = first_at if first_at is not None else now
        tpot = (now - first) / (len(generated) - 1) if len(generated) > 1 else 0.0
        self.metrics = self.engine.metrics_for(
            self.session, self.align, generated=len(generated), ttft=first - self.started, tpot=tpot
        )
        return GenerationResult(
            token_ids=tuple(generated), text=text, finish_reason=finish, metrics=self.metrics, beams=beams
        )

