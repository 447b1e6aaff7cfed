"""The scripted decode loop: the stateful engine's ``DecodeLoop`` with a scripted reply for sampling.

Yields one ``TokenDelta`` per token (text pieces never split a UTF-8 character), honours EOS,
``stop_token_ids``, ``stop_strings``, ``max_new_tokens``, ``ignore_eos`` and a constraint's
``advance`` / ``is_finished``; every token but the last is fed into the session's log::

    loop = ScriptedDecode(session, prompt, config, None, align, started)
    async for event in loop.run(reply_ids):
        ...
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING

from agentkv.engine.base import (
    BeamHypothesis,
    GenerationConfig,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
)
from agentkv.engine.detokenize import IncrementalDecoder
from agentkv.engine.sampling import StopStringMatcher

if TYPE_CHECKING:
    from agentkv.testing.session import ScriptedSession


class ScriptedDecode:
    """The decode loop of ``DecodeLoop``, with the scripted reply in place of sampling."""

    def __init__(
        self,
        session: ScriptedSession,
        prompt: list[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None,
        align: dict[str, int],
        started: float,
    ) -> None:
        self.session, self.config, self.constraint = session, config, constraint
        self.align, self.started = align, started
        engine = session.engine
        self.engine = engine
        self.eos = engine.tokenizer.eos_token_id
        self.stop_ids = frozenset(config.stop_token_ids) | (
            frozenset() if config.ignore_eos else frozenset({self.eos})
        )
        self.max_new = max(0, min(config.max_new_tokens, engine.max_context_len - len(prompt)))

    def _planned(self, reply_ids: list[int]) -> Iterator[int]:
        """The reply, then EOS (repeated while ``ignore_eos`` keeps the loop going)."""
        yield from reply_ids
        while True:
            yield self.eos

    async def run(self, reply_ids: list[int]) -> AsyncIterator[TokenDelta | GenerationResult]:
        """Yield a ``TokenDelta`` per token, then the ``GenerationResult``."""
        session, cfg = self.session, self.config
        planned = self._planned(reply_ids)
        decoder = IncrementalDecoder(self.engine.tokenizer.decode)
        stopper = StopStringMatcher(list(cfg.stop_strings))
        generated: list[int] = []
        pieces: list[str] = []
        first_at: float | None = None
        finish = "length"
        while len(generated) < self.max_new:
            token = next(planned)
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
            await session.feed([token], self.engine.decode_s_per_token)
        if finish == "stop_string":
            finish = "stop"
        else:
            tail, _ = stopper.feed(decoder.flush())
            tail += stopper.flush()
            if tail:
                pieces.append(tail)
                yield TokenDelta(generated[-1] if generated else -1, tail)
        yield self._finish(generated, "".join(pieces), finish, first_at)

    def _finish(self, generated: list[int], text: str, finish: str, first_at: float | None) -> GenerationResult:
        now = time.perf_counter()
        first = first_at if first_at is not None else now
        tpot = (now - first) / (len(generated) - 1) if len(generated) > 1 else 0.0
        metrics = self.engine.metrics_for(
            self.session, self.align, generated=len(generated), ttft=first - self.started, tpot=tpot
        )
        return GenerationResult(token_ids=tuple(generated), text=text, finish_reason=finish, metrics=metrics)


async def as_beam_search(
    events: AsyncIterator[TokenDelta | GenerationResult],
) -> AsyncIterator[TokenDelta | GenerationResult]:
    """Beam-search stream shape: one delta with the whole text, then the result with its beam."""
    async for event in events:
        if isinstance(event, GenerationResult):
            beam = BeamHypothesis(token_ids=event.token_ids, score=0.0)
            yield TokenDelta(event.token_ids[-1] if event.token_ids else -1, event.text)
            yield replace(event, beams=(beam,))
