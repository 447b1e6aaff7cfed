"""PagedSlot: one session's block table over a PagedModel — the KVSlot a KVLog runs on, paged.

It honours the slot contract of ``kv/log.py`` (feed, trim, reset, read, write), so the
same alignment, trim, snapshot and restore code runs on blocks instead of a stateful request.
Blocks come from the shared ``BlockPool`` as the sequence grows (first from what the pool reserved
for this slot when room was made for the step) and go back on trim and reset.
During a beam search the slot holds one table per beam row; a row continuing another
(``beam_idx``) starts as a share of its table, and a block is copied before a row writes into
it while another table holds it (copy-on-write)::

    slot = PagedSlot(model, pool)
    logits = slot.feed(np.array([ids]), past_len=0)      # [1, vocab]
    slot.trim(40)                                         # blocks past position 40 are released

Blocking; one caller at a time (the session's lease). ``read``/``write`` copy float K/V (a u8
cache dequantised / quantised in the plugin's block layout, ``engine/u8_blocks.py``);
``read_blocks``/``write_blocks`` copy the raw blocks, the bit-exact form of any cache.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import BLOCK_SIZE, PagedModel, SequenceStep, lock_calling_first
from agentkv.engine.paged.batcher import AloneSteps, StepBatcher
from agentkv.engine.decode.prompt_lookup import MAX_DRAFT
from agentkv.engine.decode.step_counts import StepCounts
from agentkv.kv.precision import from_bf16_bits, to_bf16_bits
from agentkv.errors import KVPoolExhausted, SnapshotIncompatible, UserError


def blocks_for(tokens: int) -> int:
    """Blocks that hold ``tokens`` positions: ``blocks_for(33) == 2``."""
    return -(-tokens // BLOCK_SIZE)


class PagedSlot:
    """A block table and a length over a shared model and block pool."""

    def __init__(self, model: PagedModel, pool: BlockPool, batcher: StepBatcher | None = None) -> None:
        """``batcher``: run feeds through it, so sessions feeding at the same time share a step
        (None: each feed is a step of its own)."""
        self.model = model
        self.pool = pool
        self.batcher = batcher
        self.blocks: list[int] = []
        """The block table (of row 0): block i holds positions ``i*BLOCK_SIZE ..``."""
        self._extra_rows: list[list[int]] = []  # rows 1.. during a beam search
        self._length = 0
        self.steps = StepCounts()
        """The model steps this slot's feeds ran in: how many, mean batch, time queued."""

    def feed(
        self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None, position_offset: int = 0
    ) -> np.ndarray:
        """Run ``input_ids`` ``[rows, T]`` after ``past_len`` cached positions; logits ``[rows, vocab]``
        (``position_offset`` shifts the position ids, to measure RoPE). ``beam_idx`` ``[rows]``
        makes row i continue the table of row ``beam_idx[i]`` (beam search: rows share blocks)."""
        ids = np.asarray(input_ids)
        if past_len != self._length:
            raise UserError(f"a paged slot feeds after its {self._length} positions, got past_len {past_len}")
        one_row = ids.shape[0] == 1 and not self._extra_rows
        if not one_row or (beam_idx is not None and list(np.asarray(beam_idx)) != [0]):
            return self._feed_rows(ids, past_len, beam_idx)
        return self._feed_one([int(t) for t in ids[0]], past_len, position_offset, last_rows=1)

    def feed_rows(self, input_ids: np.ndarray, past_len: int, rows: int) -> np.ndarray:
        """``feed`` of one row ``[1, T]`` returning the logits of its last ``rows`` positions,
        ``[rows, vocab]`` (the last row follows the last id), in one step: how a draft is verified."""
        ids = np.asarray(input_ids)
        if past_len != self._length or self._extra_rows or ids.shape[0] != 1 or not 1 <= rows <= ids.shape[1]:
            raise UserError(f"feed_rows takes one row after the slot's {self._length} positions and 1..T rows "
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
        if past_len != self._length or self._extra_rows or steps < 1:
            raise UserError(f"feed_run takes one row after the slot's {self._length} positions and steps >= 1 "
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
        model, table = self.model, self.blocks
        self._own_block(table, past_len)  # NOTE: only the first write can land in a shared block
        self._grow(table, past_len + 1)
        while True:
            began = time.perf_counter()
            top, row = model.step_alone(token, past_len, table, while_running=on_start)
            on_start = None
            past_len = self._length = past_len + 1
            self.steps.add(1, 0.0)
            if alone is not None:
                alone.counted(began)
            token = top if greedy else choose(row)
            chosen.append(token)
            # NOTE: ends(token) last: a run handed back to others ends anyway, and ends may spend
            # the token's chance to draft (``Drafts.lookahead``), which the next feed then has
            if len(chosen) >= until or (alone is not None and alone.others_waiting) or ends(token) \
                    or not self._took_block_for(past_len + 1):
                return np.array(row, dtype=np.float32)

    def _took_block_for(self, tokens: int) -> bool:
        """Grow the table to hold ``tokens`` positions from the free blocks; False (nothing taken)
        when none is free without making room."""
        try:
            self._grow(self.blocks, tokens)
        except KVPoolExhausted:
            return False
        return True

    def draft_cap(self) -> int:
        """The most drafted tokens this slot's next feed should carry now (``slot.draft_cap()``):
        ``MAX_DRAFT`` when it steps alone, else what the batcher's draft budget allows (0 or
        ``MAX_DRAFT``: drafts may slow the sessions sharing their steps by ≤ 5 %; ``draft_share.py``)."""
        if self.batcher is None:
            return MAX_DRAFT
        return self.batcher.load(self).draft_cap

    def _feed_one(self, row: list[int], past_len: int, position_offset: int, *, last_rows: int) -> np.ndarray:
        """One row on the slot's own table: logits ``[last_rows, vocab]``."""
        self._own_block(self.blocks, past_len)
        self._grow(self.blocks, past_len + len(row))
        sequence = SequenceStep(row, past_len, list(self.blocks), position_offset, last_rows)
        if self.batcher is None:
            logits = self.model.step([sequence])
            self.steps.add(1, 0.0)
        else:
            outcome = self.batcher.run(sequence, caller=self)
            logits = outcome.logits[None] if outcome.positions is None else outcome.positions
            self.steps.add(outcome.batch_size, outcome.queued_s)
        self._length = past_len + len(row)
        return logits

    def _feed_rows(self, ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None) -> np.ndarray:
        """Several rows in one step, each on its own table; a row's table starts as a share of
        its parent's (``beam_idx``), so rows hold common blocks until they write into them.
        On failure (no free block) the old rows are kept as they were."""
        rows = [self.blocks, *self._extra_rows]
        parents = list(range(ids.shape[0])) if beam_idx is None else [int(i) for i in np.asarray(beam_idx)]
        if len(parents) != ids.shape[0] or not all(0 <= p < len(rows) for p in parents):
            raise UserError(f"beam_idx {parents} does not pick {ids.shape[0]} of the slot's {len(rows)} rows")
        tables = []
        try:
            for parent in parents:
                table = list(rows[parent])
                self.pool.share(table)
                tables.append(table)
                self._own_block(table, past_len)
                self._grow(table, past_len + ids.shape[1])
        except BaseException:
            for table in tables:
                self.pool.release(table)
            raise
        for table in rows:
            self.pool.release(table)
        self.blocks, self._extra_rows = tables[0], tables[1:]
        logits = self.model.step([SequenceStep([int(t) for t in row], past_len, table)
                                  for row, table in zip(ids, tables)])
        self.steps.add(len(tables), 0.0)
        self._length = past_len + ids.shape[1]
        return logits

    def length(self) -> int:
        return self._length

    @property
    def rows(self) -> int:
        """Block tables the slot holds: 1, or a beam search's rows (``slot.rows``)."""
        return 1 + len(self._extra_rows)

    @property
    def tables(self) -> list[list[int]]:
        """Every row's block table, row 0 first (``slot.tables[0] is slot.blocks``)."""
        return [self.blocks, *self._extra_rows]

    def private_blocks(self) -> int:
        """Blocks no other table holds (a cached prefix, a fork): what emptying the slot frees
        (``slot.private_blocks()``)."""
        held = Counter(block for table in self.tables for block in table)
        return sum(1 for block, count in held.items() if self.pool.holders(block) == count)

    def reset(self) -> None:
        """Empty the slot: its blocks go back to the pool, and so does what the pool still had
        reserved for it (the slot is offloaded, released, or its step failed)."""
        self._release_tables()
        self.pool.unreserve(self)

    def _release_tables(self) -> None:
        """Let go of every row's blocks, keeping the reservation (a write that fills the slot next)."""
        for table in (self.blocks, *self._extra_rows):
            self.pool.release(table)
        self.blocks, self._extra_rows, self._length = [], [], 0

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions; blocks past them go back to the pool."""
        if n >= self._length:
            return
        keep = blocks_for(n)
        for table in (self.blocks, *self._extra_rows):
            self.pool.release(table[keep:])
            del table[keep:]
        self._length = n

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[layers, 1, heads, T, head_dim]`` (copies; a u8 cache dequantised)."""
        return read_table(self.model, self.blocks, self._length)

    @property
    def stored_precision(self) -> str:
        """The form ``write`` also takes as is: the cache's precision (f16 values, bf16 bits as uint16)."""
        return self.model.kv_cache_precision

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the KV by ``keys`` / ``values`` ``[layers, 1, heads, T, head_dim]``: float32 (a
        u8 cache quantises them in its own block layout), or a 16-bit cache's own storage form."""
        if keys.shape[1] != 1:
            raise UserError("a paged slot holds one sequence: write [layers, 1, heads, T, dim]")
        self._release_tables()
        length = keys.shape[3]
        self._grow(self.blocks, length)
        with self.model.lock:
            for layer, (k_cache, v_cache) in enumerate(self.model.cache_layers()):
                _scatter(self.model, k_cache, self.blocks, keys[layer, 0], key=True)
                _scatter(self.model, v_cache, self.blocks, values[layer, 0], key=False)
        self._length = length

    def read_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """The table's raw blocks, every layer: K ``[layers, n, *key block]`` and V
        ``[layers, n, *value block]`` in the cache's own dtype (copies): the bit-exact form."""
        return read_raw_blocks(self.model, self.blocks)

    def write_blocks(self, keys: np.ndarray, values: np.ndarray, length: int) -> None:
        """Replace the KV by raw blocks from ``read_blocks`` holding ``length`` positions."""
        if keys.shape[1] != blocks_for(length) or values.shape[1] != keys.shape[1]:
            raise UserError(f"{keys.shape[1]} raw blocks cannot hold exactly {length} positions")
        if (tuple(keys.shape[2:]), tuple(values.shape[2:])) != self.model.block_shapes or keys.dtype != np.uint8:
            raise SnapshotIncompatible(f"raw blocks {keys.shape[2:]}/{values.shape[2:]} do not match this cache's "
                                       f"{self.model.block_shapes}; re-prefill the history instead")
        self._release_tables()
        self._grow(self.blocks, length)
        with self.model.lock:
            for layer, (k_cache, v_cache) in enumerate(self.model.cache_layers()):
                k_cache[self.blocks] = keys[layer]
                v_cache[self.blocks] = values[layer]
        self._length = length

    def select_row(self, row: int, n: int) -> None:
        """Keep only row ``row`` (its table) and its first ``n`` positions."""
        rows = [self.blocks, *self._extra_rows]
        if not 0 <= row < len(rows):
            raise UserError(f"row {row} is not one of the slot's {len(rows)} rows")
        for i, table in enumerate(rows):
            if i != row:
                self.pool.release(table)
        self.blocks, self._extra_rows = rows[row], []
        self.trim(n)

    def attach(self, blocks: list[int], length: int) -> None:
        """Make ``blocks`` (references already held for this slot) the table, holding ``length``
        positions: how a shared prefix is used without a copy."""
        if blocks_for(length) != len(blocks):
            raise UserError(f"{len(blocks)} blocks cannot hold exactly {length} positions")
        self._release_tables()
        self.blocks, self._length = list(blocks), length

    def _own_block(self, table: list[int], position: int) -> None:
        """Copy-on-write: before writing at ``position``, a block of ``table`` other tables also
        hold is replaced by a private copy, so what they read never changes."""
        index = position // BLOCK_SIZE
        if index < len(table) and self.pool.holders(table[index]) > 1:
            [copy] = self.pool.allocate(1, holder=self)
            self.model.copy_block(table[index], copy)
            self.pool.release([table[index]])
            table[index] = copy

    def _grow(self, table: list[int], tokens: int) -> None:
        missing = blocks_for(tokens) - len(table)
        if missing > 0:
            table.extend(self.pool.allocate(missing, holder=self))


def read_raw_blocks(model: PagedModel, blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Raw K ``[layers, n, *key block]`` and V ``[layers, n, *value block]`` of ``blocks`` (copies)."""
    picked = list(blocks)
    with model.lock:
        layers = [(k[picked], v[picked]) for k, v in model.cache_layers()]
    return np.stack([k for k, _ in layers]), np.stack([v for _, v in layers])


def read_table(model: PagedModel, blocks: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V ``[layers, 1, heads, length, head_dim]`` held by a block table (copies)."""
    keys, values = [], []
    with model.lock:
        for k_cache, v_cache in model.cache_layers():
            keys.append(_gather(model, k_cache, list(blocks), length, key=True))
            values.append(_gather(model, v_cache, list(blocks), length, key=False))
    return np.stack(keys)[:, None], np.stack(values)[:, None]


def read_table_stored(model: PagedModel, blocks: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[layers, 1, heads, length, head_dim]`` of a block table in the cache's own 16-bit
    storage (float16, or a bf16 cache's bits as uint16), no float32 pass: copies for a snapshot."""
    if model.kv_cache_precision not in ("f16", "bf16"):
        raise UserError(f"a {model.kv_cache_precision} cache has no 16-bit storage to read: use read_table")
    keys, values = [], []
    with model.lock:
        for k_cache, v_cache in model.cache_layers():
            keys.append(_flat(k_cache[list(blocks)], length))
            values.append(_flat(v_cache[list(blocks)], length))
    return np.stack(keys)[:, None], np.stack(values)[:, None]


def _flat(picked: np.ndarray, length: int) -> np.ndarray:
    """``[heads, length, dim]`` of blocks ``[n, heads, rows, dim]`` (rows: a block's positions)."""
    heads, dim = picked.shape[1], picked.shape[3]
    return picked.transpose(1, 0, 2, 3).reshape(heads, -1, dim)[:, :length]


def _gather(model: PagedModel, cache: np.ndarray, blocks: list[int], length: int, *, key: bool) -> np.ndarray:
    """``[heads, length, dim]`` float32 from ``cache[blocks]`` (``[n, heads, rows, cols]``; a bf16
    cache shows as 16-bit numbers: its bits are converted, not its values)."""
    picked = cache[blocks]
    if model.kv_cache_precision == "u8":
        return model.u8_layout(key=key).dequantize(picked, length)
    flat = _flat(picked, length)
    if model.kv_cache_precision == "bf16":
        return from_bf16_bits(flat.view(np.uint16))
    return np.array(flat, dtype=np.float32)


def _scatter(model: PagedModel, cache: np.ndarray, blocks: list[int], kv: np.ndarray, *, key: bool) -> None:
    """Write ``kv`` ``[heads, T, dim]`` into ``cache[blocks]`` (the tail of the last block is zeroed)."""
    if model.kv_cache_precision == "u8":
        cache[blocks] = model.u8_layout(key=key).quantize(kv, len(blocks))
        return
    heads, length, dim = kv.shape
    bf16 = model.kv_cache_precision == "bf16"
    target = cache.view(np.uint16) if bf16 else cache
    padded = np.zeros((heads, len(blocks) * BLOCK_SIZE, dim), dtype=target.dtype)
    stored = kv.dtype.itemsize == 2  # NOTE: already the cache's form (f16 values, bf16 bits)
    padded[:, :length] = to_bf16_bits(kv) if bf16 and not stored else kv.view(target.dtype) if stored else kv
    target[blocks] = padded.reshape(heads, len(blocks), BLOCK_SIZE, dim).transpose(1, 0, 2, 3)
