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
from typing import TYPE_CHECKING

import anyio
import numpy as np

from agentkv.engine.base import BeamHypothesis, GenerationResult
from agentkv.engine.beam import BeamSearch, BeamWinner

if TYPE_CHECKING:
    from agentkv.engine.decode import DecodeLoop


async def run_beam_search(loop: DecodeLoop) -> GenerationResult:
    """Run the search to its end and return the winner (with ``beams`` ranked)."""
    session, slot, prompt = loop.session, loop.slot, loop.prompt
    config = loop.config.model_copy(update={"max_new_tokens": loop.max_new})
    search = BeamSearch(config, loop.engine.eos_token_ids, prompt_len=len(prompt))
    assert session._last_logits is not None
    prompt_logits = session._last_logits
    kv_len = len(prompt)
    first_at: float | None = None
    collapsed = False
    try:
        step = search.step(session._last_logits[None, :])
        while step is not None:
            ids = step.next_tokens[:, None]
            logits = await session._run(slot.feed, ids, kv_len, step.beam_idx)
            kv_len += 1
            if first_at is None:
                first_at = time.perf_counter()
            step = search.step(logits)
        winner = search.winner
        await session._run(_collapse_to_winner, session, slot, prompt, winner, kv_len)
        collapsed = True
    finally:
        if not collapsed:
            with anyio.CancelScope(shield=True):
                await session._run(_collapse_to_prompt, session, slot, prompt)
                session._last_logits = prompt_logits
    beams = tuple(BeamHypothesis(h.token_ids, float(h.score)) for h in search.finalize())
    text_ids = [t for t in winner.token_ids if t not in loop.stop_ids]
    text = loop.engine.tokenizer.decode(text_ids) if text_ids else ""
    return loop.finish(list(winner.token_ids), text, winner.finish_reason, first_at, beams)


def _collapse_to_winner(session, slot, prompt: list[int], winner: BeamWinner, kv_len: int) -> None:  # type: ignore[no-untyped-def]
    """Leave one row holding prompt + the winner's tokens (all but a final stop token)."""
    tokens = list(winner.token_ids)
    keep = tokens[:-1] if tokens and tokens[-1] in session._engine.eos_token_ids else tokens
    rest = keep[winner.common_tokens :]
    if winner.kv_len == kv_len and rest:
        # The winner's row is live: the cache reorder beam_idx=[row] collapses the batch on
        # the same infer that feeds its remaining tokens.
        logits = slot.feed(np.array([rest], dtype=np.int64), kv_len, np.array([winner.row], dtype=np.int32))
        session._tokens = prompt + keep
        session._last_logits = logits[0]
        return
    slot.select_row(winner.row, winner.kv_len)
    session._tokens = prompt + tokens[: winner.common_tokens]
    session._last_logits = None
    if rest:
        session._feed_blocking(slot, rest)


def _collapse_to_prompt(session, slot, prompt: list[int]) -> None:  # type: ignore[no-untyped-def]
    """Drop every beam: one row holding the prompt (whose logits stay valid)."""
    slot.select_row(0, len(prompt))
    session._tokens = list(prompt)
