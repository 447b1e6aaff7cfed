"""Beam search on a KV session through the model's ``beam_idx`` cache reorder.

The slot's single row is expanded to N beams by the first step (``beam_idx=[0]*N``), each
step reorders rows by the parents' indices, and the end collapses the batch back to the
winning beam — by ``beam_idx=[row]`` on the feed of the winner's remaining tokens when its row
is live, else through the state API (keep the row, trim to the winner's common prefix). The
session then continues from the winner with the invariant intact. On cancellation or error
the slot is collapsed back to the prompt.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

import anyio

from agentkv.engine.base import GenerationConfig, Tokenizer
from agentkv.engine.generation import BeamHypothesis, GenerationResult
from agentkv.engine.decode.beam import BeamSearch, BeamWinner
from agentkv.kv.log import KVLog, KVSlot


class BeamBackend(Protocol):
    """What beam search reads of the backend its session works through."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    def room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1,
             rewrite: bool = False) -> AbstractAsyncContextManager[None]: ...


class BeamRun(Protocol):
    """The generation a beam search runs inside (``decode/loop.py``'s ``DecodeLoop``)."""

    @property
    def engine(self) -> BeamBackend: ...
    log: KVLog
    slot: KVSlot
    run_blocking: Callable[..., Awaitable[Any]]
    prompt: list[int]
    config: GenerationConfig
    max_new: int
    stop_ids: frozenset[int]

    def finish(self, generated: list[int], text: str, finish: str, first_at: float | None,
               beams: tuple[BeamHypothesis, ...] = ()) -> GenerationResult: ...


async def run_beam_search(loop: BeamRun) -> GenerationResult:
    """Run the search to its end and return the winner (with ``beams`` ranked)."""
    log, slot, prompt, run = loop.log, loop.slot, loop.prompt, loop.run_blocking
    config = loop.config.model_copy(update={"max_new_tokens": loop.max_new})
    search = BeamSearch(config, loop.engine.eos_token_ids, prompt_len=len(prompt))
    assert log.last_logits is not None
    prompt_logits = log.last_logits
    kv_len = len(prompt)
    first_at: float | None = None
    collapsed = False
    try:
        step = search.step(prompt_logits[None, :])
        while step is not None:
            ids = step.next_tokens[:, None]
            async with loop.engine.room(slot, 1, rows=len(ids)):
                logits = await run(slot.feed, ids, kv_len, step.beam_idx)  # rows diverge: the log waits
            kv_len += 1
            if first_at is None:
                first_at = time.perf_counter()
            step = search.step(logits)
        winner = search.winner
        await _collapse_to_winner(loop, winner, kv_len)
        collapsed = True
    finally:
        if not collapsed:
            with anyio.CancelScope(shield=True):
                await run(log.collapse, slot, 0, prompt, prompt_logits)  # one row: the prompt
    beams = tuple(BeamHypothesis(h.token_ids, float(h.score)) for h in search.finalize())
    text_ids = [t for t in winner.token_ids if t not in loop.stop_ids]
    text = loop.engine.tokenizer.decode(text_ids) if text_ids else ""
    return loop.finish(list(winner.token_ids), text, winner.finish_reason, first_at, beams)


async def _collapse_to_winner(loop: BeamRun, winner: BeamWinner, kv_len: int) -> None:
    """Leave one row holding prompt + the winner's tokens (all but a final stop token), room
    made for the blocks the feed of its remaining tokens takes (a copy of the block it writes into
    and its growth)."""
    log, slot, run = loop.log, loop.slot, loop.run_blocking
    tokens = list(winner.token_ids)
    keep = tokens[:-1] if tokens and tokens[-1] in loop.engine.eos_token_ids else tokens
    rest = keep[winner.common_tokens :]
    if winner.kv_len == kv_len and rest:
        # The winner's row is live: the cache reorder beam_idx=[row] collapses the batch on
        # the same infer that feeds its remaining tokens.
        async with loop.engine.room(slot, len(rest)):
            await run(log.collapse_feeding, slot, winner.row, keep[: winner.common_tokens], rest)
        return
    await run(log.collapse, slot, winner.row, loop.prompt + tokens[: winner.common_tokens])
    if rest:
        async with loop.engine.room(slot, len(rest)):
            await run(log.feed, slot, rest)
