"""PagedSlot: the KVSlot a KVLog runs on, paged — a block table (cache side) composed with the model (runner side).

It honours the slot contract of ``kv/log.py`` (feed, trim, reset, read, write), so the
same alignment, trim, snapshot and restore code runs on blocks instead of a stateful request.
Which blocks hold the session's KV is its ``BlockTable``'s business (``block_table.py``: blocks
taken from the shared pool as the sequence grows, given back on trim and reset, copied before a
write into a shared one, one row per beam); this class feeds the model — alone, or through the
step batcher with other sessions — at the positions the table names, and moves KV in and out of
those blocks (``block_io.py``)::

    slot = PagedSlot(model, pool)
    logits = slot.feed(np.array([ids]), past_len=0)      # [1, vocab]
    slot.trim(40)                                         # blocks past position 40 are released

Blocking; one caller at a time (the session's lease). ``read``/``write`` copy float K/V;
``read_blocks``/``write_blocks`` copy the raw blocks, the bit-exact form of any cache.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from agentkv.engine.paged.batcher import AloneSteps, StepBatcher
from agentkv.engine.paged.block_io import read_raw_blocks, read_table, write_raw_blocks, write_table
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.block_table import BlockTable, blocks_for
from agentkv.engine.paged.model import PagedModel, SequenceStep, lock_calling_first
from agentkv.engine.decode.prompt_lookup import MAX_DRAFT
from agentkv.engine.decode.step_counts import StepCounts
from agentkv.errors import SnapshotIncompatible, UserError


class PagedSlot:
    """A block table over a shared block pool, fed by a shared model. See the module docstring."""

    def __init__(self, model: PagedModel, pool: BlockPool, batcher: StepBatcher | None = None) -> None:
        """``batcher``: run feeds through it, so sessions feeding at the same time share a step
        (None: each feed is a step of its own)."""
        self.model = model
        self.batcher = batcher
        self.table = BlockTable(pool, copy_block=lambda source, target: model.copy_block(source, target))
        """Which pool blocks hold this slot's KV (the cache side: grows, trims, copies on write)."""
        self.steps = StepCounts()
        """The model steps this slot's feeds ran in: how many, mean batch, time queued."""

    @property
    def blocks(self) -> list[int]:
        """Row 0's blocks (``slot.table.row``): block i holds positions ``i*BLOCK_SIZE ..``."""
        return self.table.row

    def feed(
        self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None, position_offset: int = 0
    ) -> np.ndarray:
        """Run ``input_ids`` ``[rows, T]`` after ``past_len`` cached positions; logits ``[rows, vocab]``
        (``position_offset`` shifts the position ids, to measure RoPE). ``beam_idx`` ``[rows]``
        makes row i continue the table of row ``beam_idx[i]`` (beam search: rows share blocks)."""
        ids = np.asarray(input_ids)
        if past_len != self.table.length:
            raise UserError(f"a paged slot feeds after its {self.table.length} positions, got past_len {past_len}")
        one_row = ids.shape[0] == 1 and len(self.table.rows) == 1
        if not one_row or (beam_idx is not None and list(np.asarray(beam_idx)) != [0]):
            return self._feed_rows(ids, past_len, beam_idx)
        return self._feed_one([int(t) for t in ids[0]], past_len, position_offset, last_rows=1)

    def feed_rows(self, input_ids: np.ndarray, past_len: int, rows: int) -> np.ndarray:
        """``feed`` of one row ``[1, T]`` returning the logits of its last ``rows`` positions,
        ``[rows, vocab]`` (the last row follows the last id), in one step: how a draft is verified."""
        ids = np.asarray(input_ids)
        if past_len != self.table.length or self.rows > 1 or ids.shape[0] != 1 or not 1 <= rows <= ids.shape[1]:
            raise UserError(f"feed_rows takes one row after the slot's {self.table.length} positions and 1..T rows "
                            f"(got past_len {past_len}, shape {ids.shape}, rows {rows})")
        return self._feed_one([int(t) for t in ids[0]], past_len, 0, last_rows=rows)

    def feed_run(self, token: int, past_len: int, *, steps: int, choose: Callable[[np.ndarray], int],
                 ends: Callable[[int], bool], chosen: list[int], greedy: bool = False,
                 started: Callable[[], None] | None = None) -> np.ndarray:
        """Feed ``token``, append ``choose(logits)`` to ``chosen``, and go on feeding each token so
        chosen until this call has chosen ``steps`` tokens, ``ends(token)`` says so, or another
        session queues for a step; the last step's logits ``[vocab]`` (a copy). While nobody else
        steps, the steps run back to back on the decode graph (``StepBatcher.alone``,
        ``PagedModel.step_alone``: ~0.5 ms of Python a token less than ``feed``, measured); with
        others stepping, one ordinary batched step. ``greedy``: ``choose`` is the argmax, so the
        steps alone take the graph's own (``next_token``) instead of reading the logits. The caller
        makes room for the first step; a later step that needs a block takes a free one, or ends
        the run when none is (the next feed makes room, as one token per feed would). ``started()``
        (``RunStep.started``) is called while the first step alone computes, or before a batched
        one or a wait for another thread's hold on the model. The slot's
        length says how many tokens were fed, also after a failure. How a run steps::

            chosen = []
            slot.feed_run(t, 130, steps=8, choose=argmax, ends=lambda t: t == eos, chosen=chosen)
        """
        if past_len != self.table.length or self.rows > 1 or steps < 1:
            raise UserError(f"feed_run takes one row after the slot's {self.table.length} positions and steps >= 1 "
                            f"(got past_len {past_len}, {self.rows} rows, steps {steps})")
        if self.batcher is None:  # NOTE: the lock keeps other slots' steps, and the logits array they share, out
            started = lock_calling_first(self.model.lock, started)
            try:
                return self._run(token, past_len, len(chosen) + steps, choose, ends, chosen, greedy, None, started)
            finally:
                self.model.lock.release()
        alone = self.batcher.alone(self)
        if alone is None:
            if started is not None:
                started()
            logits: np.ndarray = self._feed_one([token], past_len, 0, last_rows=1)[0]
            chosen.append(choose(logits))
            return logits
        try:
            return self._run(token, past_len, len(chosen) + steps, choose, ends, chosen, greedy, alone, started)
        finally:
            alone.close()

    def _run(self, token: int, past_len: int, until: int, choose: Callable[[np.ndarray], int],
             ends: Callable[[int], bool], chosen: list[int], greedy: bool, alone: AloneSteps | None,
             on_start: Callable[[], None] | None) -> np.ndarray:
        """``feed_run``'s steps with the model to itself (``alone``: lent by the batcher)."""
        model, table = self.model, self.table
        table.prepare_write(table.row, past_len, 1)  # NOTE: only the first write can land in a shared block
        while True:
            began = time.perf_counter()
            top, row = model.step_alone(token, past_len, table.row, while_running=on_start)
            on_start = None
            past_len = table.length = past_len + 1
            self.steps.add(1, 0.0)
            if alone is not None:
                alone.counted(began)
            token = top if greedy else choose(row)
            chosen.append(token)
            # NOTE: ends(token) last: a run handed back to others ends anyway, and ends may spend
            # the token's chance to draft (``Drafts.lookahead``), which the next feed then has
            if len(chosen) >= until or (alone is not None and alone.others_waiting) or ends(token) \
                    or not table.try_grow(past_len + 1):
                return np.array(row, dtype=np.float32)

    def draft_cap(self) -> int:
        """The most drafted tokens this slot's next feed should carry now (``slot.draft_cap()``):
        ``MAX_DRAFT`` when it steps alone, else what the batcher's draft budget allows (0 or
        ``MAX_DRAFT``: drafts may slow plain sessions sharing their steps by ≤ 5 %, and sessions that
        all draft verify together; ``draft_share.py``). Asked only with a draft to feed."""
        if self.batcher is None:
            return MAX_DRAFT
        return self.batcher.draft_cap(self)

    def draft_outcome(self, drafted: int, accepted: int) -> None:
        """A draft this slot fed ended, ``accepted`` of its ``drafted`` tokens confirmed: the
        batcher weighs drafting together by it (``draft_payoff.py``)."""
        if self.batcher is not None:
            self.batcher.note_draft(drafted, accepted)

    def _feed_one(self, row: list[int], past_len: int, position_offset: int, *, last_rows: int) -> np.ndarray:
        """One row on the slot's own table: logits ``[last_rows, vocab]``."""
        self.table.prepare_write(self.table.row, past_len, len(row))
        sequence = SequenceStep(row, past_len, list(self.table.row), position_offset, last_rows)
        if self.batcher is None:
            logits = self.model.step([sequence])
            self.steps.add(1, 0.0)
        else:
            outcome = self.batcher.run(sequence, caller=self)
            logits = outcome.logits[None] if outcome.positions is None else outcome.positions
            self.steps.add(outcome.batch_size, outcome.queued_s)
        self.table.length = past_len + len(row)
        return logits

    def _feed_rows(self, ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None) -> np.ndarray:
        """Several rows in one step, each on its own row of the table; a row starts as a share of
        its parent's (``beam_idx``), so rows hold common blocks until they write into them.
        On failure (no free block) the old rows are kept as they were."""
        parents = list(range(ids.shape[0])) if beam_idx is None else [int(i) for i in np.asarray(beam_idx)]
        if len(parents) != ids.shape[0]:
            raise UserError(f"beam_idx {parents} does not pick {ids.shape[0]} of the slot's {self.rows} rows")
        self.table.branch_rows(parents, past_len, ids.shape[1])
        rows = self.table.rows
        logits = self.model.step([SequenceStep([int(t) for t in ids_row], past_len, row)
                                  for ids_row, row in zip(ids, rows)])
        self.steps.add(len(rows), 0.0)
        self.table.length = past_len + ids.shape[1]
        return logits

    def length(self) -> int:
        return self.table.length

    @property
    def rows(self) -> int:
        """Rows the slot feeds: 1, or a beam search's rows (``slot.rows``)."""
        return len(self.table.rows)

    def reset(self) -> None:
        """Empty the slot: its blocks go back to the pool, and what the pool still had reserved
        for it (``BlockTable.reset``)."""
        self.table.reset()

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions; blocks past them go back to the pool."""
        self.table.trim(n)

    def select_row(self, row: int, n: int) -> None:
        """Keep only row ``row`` and its first ``n`` positions (a beam search's winner)."""
        self.table.select_row(row, n)

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[layers, 1, heads, T, head_dim]`` (copies; a u8 cache dequantised)."""
        return read_table(self.model, self.table.row, self.table.length)

    @property
    def stored_precision(self) -> str:
        """The form ``write`` also takes as is: the cache's precision (f16 values, bf16 bits as uint16)."""
        return self.model.kv_cache_precision

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the KV by ``keys`` / ``values`` ``[layers, 1, heads, T, head_dim]``: float32 (a
        u8 cache quantises them in its own block layout), or a 16-bit cache's own storage form."""
        if keys.shape[1] != 1:
            raise UserError("a paged slot holds one sequence: write [layers, 1, heads, T, dim]")
        self.table.release_rows()
        length = keys.shape[3]
        self.table.grow(self.table.row, length)
        write_table(self.model, self.table.row, keys, values)
        self.table.length = length

    def read_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """The table's raw blocks, every layer: K ``[layers, n, *key block]`` and V
        ``[layers, n, *value block]`` in the cache's own dtype (copies): the bit-exact form."""
        return read_raw_blocks(self.model, self.table.row)

    def write_blocks(self, keys: np.ndarray, values: np.ndarray, length: int) -> None:
        """Replace the KV by raw blocks from ``read_blocks`` holding ``length`` positions."""
        if keys.shape[1] != blocks_for(length) or values.shape[1] != keys.shape[1]:
            raise UserError(f"{keys.shape[1]} raw blocks cannot hold exactly {length} positions")
        if (tuple(keys.shape[2:]), tuple(values.shape[2:])) != self.model.block_shapes or keys.dtype != np.uint8:
            raise SnapshotIncompatible(f"raw blocks {keys.shape[2:]}/{values.shape[2:]} do not match this cache's "
                                       f"{self.model.block_shapes}; re-prefill the history instead")
        self.table.release_rows()
        self.table.grow(self.table.row, length)
        write_raw_blocks(self.model, self.table.row, keys, values)
        self.table.length = length
