"""The scripted decode loop: the stateful engine's ``DecodeLoop`` with a scripted reply for sampling.

Yields one ``TokenDelta`` per token (text pieces never split a UTF-8 character), honours EOS,
``stop_token_ids``, ``stop_strings``, ``max_new_tokens``, ``ignore_eos`` and a constraint's
``advance`` / ``is_finished``; every token but the last is fed into the session's log::

    loop = ScriptedDecode(session, prompt, config, None, align, started)
    async for event in loop.run(reply_ids):
        ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import replace
from typing import Any, Protocol

from agentkv.engine.base import (
    Alignment,
    BeamHypothesis,
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
)
from agentkv.engine.decode import DecodeOutcome, decode_tokens, stop_ids_for, timing



class _ReplyTokenizer(Protocol):
    eos_token_id: int

    def decode(self, ids: Sequence[int]) -> str: ...


class ScriptedHost(Protocol):
    """What the scripted decode loop reads of its engine (``ScriptedEngine``)."""

    @property
    def tokenizer(self) -> _ReplyTokenizer: ...
    @property
    def max_context_len(self) -> int: ...
    decode_s_per_token: float

    def metrics_for(self, session: Any, align: Alignment, *, generated: int, ttft: float,
                    tpot: float) -> GenerationMetrics: ...


class ScriptedLog(Protocol):
    """The session a scripted decode feeds (``ScriptedSession``)."""

    @property
    def engine(self) -> ScriptedHost: ...
    async def feed(self, ids: Sequence[int], seconds_per_token: float) -> None: ...


class ScriptedDecode:
    """The decode loop of ``DecodeLoop``, with the scripted reply in place of sampling."""

    def __init__(
        self,
        session: ScriptedLog,
        prompt: list[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None,
        align: Alignment,
        started: float,
    ) -> None:
        self.session, self.config, self.constraint = session, config, constraint
        self.align, self.started = align, started
        engine = session.engine
        self.engine = engine
        self.eos = engine.tokenizer.eos_token_id
        self.stop_ids = stop_ids_for(config, frozenset({self.eos}))
        self.max_new = max(0, min(config.max_new_tokens, engine.max_context_len - len(prompt)))

    def _planned(self, reply_ids: list[int]) -> Iterator[int]:
        """The reply, then EOS (repeated while ``ignore_eos`` keeps the loop going)."""
        yield from reply_ids
        while True:
            yield self.eos

    async def run(self, reply_ids: list[int]) -> AsyncIterator[TokenDelta | GenerationResult]:
        """Yield a ``TokenDelta`` per token, then the ``GenerationResult``."""
        planned = self._planned(reply_ids)

        async def feed(token: int) -> None:
            await self.session.feed([token], self.engine.decode_s_per_token)

        events = decode_tokens(
            lambda generated: next(planned), feed, config=self.config,
            decode_text=self.engine.tokenizer.decode, stop_ids=self.stop_ids,
            max_new=self.max_new, constraint=self.constraint,
        )
        async for event in events:
            if isinstance(event, DecodeOutcome):
                yield self._finish(event)
            else:
                yield event

    def _finish(self, outcome: DecodeOutcome) -> GenerationResult:
        generated = outcome.generated
        ttft, tpot = timing(self.started, outcome.first_token_at, len(generated))
        metrics = self.engine.metrics_for(self.session, self.align, generated=len(generated), ttft=ttft, tpot=tpot)
        return GenerationResult(
            token_ids=tuple(generated), text=outcome.text, finish_reason=outcome.finish_reason, metrics=metrics
        )


async def as_beam_search(
    events: AsyncIterator[TokenDelta | GenerationResult],
) -> AsyncIterator[TokenDelta | GenerationResult]:
    """Beam-search stream shape: one delta with the whole text, then the result with its beam."""
    async for event in events:
        if isinstance(event, GenerationResult):
            beam = BeamHypothesis(token_ids=event.token_ids, score=0.0)
            yield TokenDelta(event.token_ids[-1] if event.token_ids else -1, event.text)
            yield replace(event, beams=(beam,))
