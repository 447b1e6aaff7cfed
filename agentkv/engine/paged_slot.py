"""PagedSlot: one sequence's block table over a PagedModel — the KVSlot a KVLog runs on, paged.

It honours the slot contract of ``engine/kv_log.py`` (feed, trim, reset, read, write), so the
same alignment, trim, snapshot and restore code runs on blocks instead of a stateful request.
Blocks come from the shared ``BlockPool`` as the sequence grows and go back on trim and reset::

    slot = PagedSlot(model, pool)
    logits = slot.feed(np.array([ids]), past_len=0)      # [1, vocab]
    slot.trim(40)                                         # blocks past position 40 are released

Blocking; one caller at a time (the session's lease). ``read``/``write`` copy float K/V for
f32 and f16 caches; a u8 cache's rows carry their quantisation parameters and are not read here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentkv.engine.block_pool import BlockPool
from agentkv.engine.paged_model import BLOCK_SIZE, PagedModel, SequenceStep
from agentkv.engine.step_batcher import StepBatcher
from agentkv.engine.kv_precision import from_bf16_bits, to_bf16_bits
from agentkv.errors import UserError


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
        """The block table: block i holds positions ``i*BLOCK_SIZE ..``."""
        self._length = 0

    def feed(
        self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None, position_offset: int = 0
    ) -> np.ndarray:
        """Run ``input_ids`` ``[1, T]`` after ``past_len`` cached positions; logits ``[1, vocab]``
        (``position_offset`` shifts the position ids, to measure RoPE)."""
        if beam_idx is not None and list(np.asarray(beam_idx)) != [0]:
            raise UserError("beam search needs the stateful engine's beam_idx: use StatefulEngine for num_beams > 1")
        if np.asarray(input_ids).shape[0] != 1 or past_len != self._length:
            raise UserError(f"a paged slot feeds one sequence after its {self._length} positions, got "
                            f"batch {np.asarray(input_ids).shape[0]} after {past_len}")
        ids = [int(t) for t in np.asarray(input_ids)[0]]
        self._own_block_at(past_len)
        self._grow(past_len + len(ids))
        sequence = SequenceStep(ids, past_len, list(self.blocks), position_offset)
        logits = self.batcher.run(sequence, caller=self)[None] if self.batcher is not None else self.model.step([sequence])
        self._length = past_len + len(ids)
        return logits

    def length(self) -> int:
        return self._length

    def reset(self) -> None:
        self.pool.release(self.blocks)
        self.blocks, self._length = [], 0

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions; blocks past them go back to the pool."""
        if n >= self._length:
            return
        keep = blocks_for(n)
        self.pool.release(self.blocks[keep:])
        del self.blocks[keep:]
        self._length = n

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[layers, 1, heads, T, head_dim]`` (copies)."""
        return read_table(self.model, self.blocks, self._length)

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the KV by ``keys`` / ``values`` ``[layers, 1, heads, T, head_dim]``."""
        self._check_float_cache("write")
        if keys.shape[1] != 1:
            raise UserError("a paged slot holds one sequence: write [layers, 1, heads, T, dim]")
        self.reset()
        length = keys.shape[3]
        self._grow(length)
        bf16 = self.model.kv_cache_precision == "bf16"
        with self.model.lock:
            for layer, (k_cache, v_cache) in enumerate(self.model.cache_layers()):
                _scatter(k_cache, self.blocks, keys[layer, 0], bf16)
                _scatter(v_cache, self.blocks, values[layer, 0], bf16)
        self._length = length

    def select_row(self, row: int, n: int) -> None:
        """Keep row ``row`` (a paged slot has only row 0) and its first ``n`` positions."""
        if row != 0:
            raise UserError("a paged slot holds one sequence (row 0)")
        self.trim(n)

    def attach(self, blocks: list[int], length: int) -> None:
        """Make ``blocks`` (references already held for this slot) the table, holding ``length``
        positions: how a shared prefix is used without a copy."""
        if blocks_for(length) != len(blocks):
            raise UserError(f"{len(blocks)} blocks cannot hold exactly {length} positions")
        self.reset()
        self.blocks, self._length = list(blocks), length

    def _own_block_at(self, position: int) -> None:
        """Copy-on-write: before writing at ``position``, a block other tables also hold is
        replaced by a private copy, so what they read never changes."""
        index = position // BLOCK_SIZE
        if index < len(self.blocks) and self.pool.holders(self.blocks[index]) > 1:
            [copy] = self.pool.allocate(1)
            self.model.copy_block(self.blocks[index], copy)
            self.pool.release([self.blocks[index]])
            self.blocks[index] = copy

    def _grow(self, tokens: int) -> None:
        missing = blocks_for(tokens) - len(self.blocks)
        if missing > 0:
            self.blocks.extend(self.pool.allocate(missing))

    def _check_float_cache(self, action: str) -> None:
        _check_float_cache(self.model, action)


def read_table(model: PagedModel, blocks: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V ``[layers, 1, heads, length, head_dim]`` held by a block table (copies)."""
    _check_float_cache(model, "read")
    keys, values = [], []
    bf16 = model.kv_cache_precision == "bf16"
    with model.lock:
        for k_cache, v_cache in model.cache_layers():
            keys.append(_gather(k_cache, list(blocks), length, bf16))
            values.append(_gather(v_cache, list(blocks), length, bf16))
    return np.stack(keys)[:, None], np.stack(values)[:, None]


def _check_float_cache(model: PagedModel, action: str) -> None:
    if model.kv_cache_precision == "u8":
        raise UserError(f"cannot {action} a u8 paged cache as floats: use kv_cache_precision='f16' or 'f32'")


def _gather(cache: np.ndarray, blocks: list[int], length: int, bf16: bool) -> np.ndarray:
    """``[heads, length, dim]`` float32 from ``cache[blocks]`` (``[n, heads, BLOCK, dim]``; a bf16
    cache shows as 16-bit numbers: its bits are converted, not its values)."""
    picked = cache[blocks]  # [n, heads, BLOCK, dim]
    heads, dim = picked.shape[1], picked.shape[3]
    flat = picked.transpose(1, 0, 2, 3).reshape(heads, -1, dim)[:, :length]
    return from_bf16_bits(flat.view(np.uint16)) if bf16 else np.array(flat, dtype=np.float32)


def _scatter(cache: np.ndarray, blocks: list[int], kv: np.ndarray, bf16: bool) -> None:
    """Write ``kv`` ``[heads, T, dim]`` into ``cache[blocks]`` (the tail of the last block is zeroed)."""
    heads, length, dim = kv.shape
    target = cache.view(np.uint16) if bf16 else cache
    padded = np.zeros((heads, len(blocks) * BLOCK_SIZE, dim), dtype=target.dtype)
    padded[:, :length] = to_bf16_bits(kv) if bf16 else kv
    target[blocks] = padded.reshape(heads, len(blocks), BLOCK_SIZE, dim).transpose(1, 0, 2, 3)
