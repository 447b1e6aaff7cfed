"""ScriptedDecode: the engine's ``DecodeLoop`` choosing the scripted reply instead of sampling.

Everything else is the real loop: one ``TokenDelta`` per token (text pieces never split a
UTF-8 character), EOS, ``stop_token_ids``, ``stop_strings``, ``max_new_tokens``,
``ignore_eos``, a constraint's ``advance`` / ``is_finished``, and every token but the last fed
into the session's KV log. With ``GenerationConfig.logprobs`` each token's log-probability comes
from a fixed distribution (``scripted_logprob``): the scripted token is the most likely::

    loop = ScriptedDecode(engine, log, slot, run, prompt, config, None, align, started, reply_ids=ids)
    async for event in loop.run():
        ...
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from dataclasses import replace
from typing import Any

from agentkv.engine.generation import BeamHypothesis, GenerationResult, TokenDelta, TokenLogprob, TopLogprob
from agentkv.engine.decode.loop import DecodeLoop

ORDINARY_IDS = 100_000
"""Ids below this are ordinary cl100k tokens (each decodes alone): the scripted alternatives."""


def scripted_logprob(token: int, top: int, decode: Callable[[list[int]], str]) -> TokenLogprob:
    """The scripted "model"'s distribution at every position: the scripted ``token`` has
    probability 1/2, the r-th next id ``(token + r) % ORDINARY_IDS`` 2^-(r+1) (so ``top``
    alternatives hold less than all the mass); ``top`` alternatives, most likely first, the
    scripted one first."""
    ids = [token if rank == 0 else (token + rank) % ORDINARY_IDS for rank in range(top)]
    alternatives = tuple(TopLogprob(i, decode([i]), -(rank + 1) * math.log(2.0)) for rank, i in enumerate(ids))
    return TokenLogprob(token, decode([token]), -math.log(2.0), alternatives)


class ScriptedDecode(DecodeLoop):
    """``DecodeLoop`` whose chooser replays ``reply_ids`` then EOS (repeated while
    ``ignore_eos`` keeps the loop going); beam search returns that reply as its one beam."""

    def __init__(self, *args: Any, reply_ids: list[int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reply_ids = reply_ids

    def chooser(self) -> Callable[[list[int]], int]:
        planned = self._planned()
        return lambda generated: next(planned)

    def scorer(self) -> Callable[[int], TokenLogprob] | None:
        top = self.config.logprobs
        if top is None:
            return None
        decode = self.engine.tokenizer.decode
        return lambda token: scripted_logprob(token, top, decode)

    def _planned(self) -> Iterator[int]:
        eos = min(self.engine.eos_token_ids)
        yield from self.reply_ids
        while True:
            yield eos

    async def run(self) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        events: AsyncIterator[TokenDelta | GenerationResult] = self.run_sequential()
        if self.config.num_beams > 1:
            events = as_beam_search(events)
        async for event in events:
            yield event


async def as_beam_search(
    events: AsyncIterator[TokenDelta | GenerationResult],
) -> AsyncIterator[TokenDelta | GenerationResult]:
    """Beam-search stream shape: one delta with the whole text, then the result with its beam."""
    async for event in events:
        if isinstance(event, GenerationResult):
            beam = BeamHypothesis(token_ids=event.token_ids, score=0.0)
            yield TokenDelta(event.token_ids[-1] if event.token_ids else -1, event.text)
            yield replace(event, beams=(beam,))
