"""BlockTable: which pool blocks hold one session's KV — the cache side of a paged slot, no model in it.

A table lists, for each row (one; a beam search's rows), the blocks that hold positions
``i*BLOCK_SIZE ..`` of that row, and how many positions they hold. It takes blocks from the
``BlockPool`` as the sequence grows (first from what the pool reserved for this table when room
was made), gives them back on trim and reset, and keeps shared blocks unchanged: before a row
writes into a block another table holds, the block is copied (copy-on-write, through the
``copy_block`` the runner side gives, which moves the KV itself)::

    table = BlockTable(pool, copy_block=model.copy_block)
    table.prepare_write(table.row, past_len=0, tokens=40)   # blocks for positions 0..39
    table.length = 40
    table.trim(33)                                           # the third block goes back

The runner side (``PagedSlot``, ``block_io``) feeds the model and reads/writes KV at the blocks a
table names; this object never touches KV. Blocking; one caller at a time (the session's lease).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Protocol

from agentkv.engine.paged.block_pool import BLOCK_SIZE, BlockPool
from agentkv.errors import KVPoolExhausted, UserError


def blocks_for(tokens: int) -> int:
    """Blocks that hold ``tokens`` positions: ``blocks_for(33) == 2``."""
    return -(-tokens // BLOCK_SIZE)


class HasBlockTable(Protocol):
    """A KV slot whose KV lives in pool blocks (``PagedSlot``): what the cache side reads of it."""

    @property
    def table(self) -> BlockTable: ...


def table_of(slot: object) -> BlockTable | None:
    """The block table of a paged slot, None for a slot that keeps its own storage:
    ``table = table_of(slot)``."""
    table = getattr(slot, "table", None)
    return table if isinstance(table, BlockTable) else None


class BlockTable:
    """One session's rows of pool blocks and the positions they hold. See the module docstring."""

    def __init__(self, pool: BlockPool, copy_block: Callable[[int, int], None]) -> None:
        """``copy_block(source, target)`` copies a block's KV in every layer (the model's)."""
        self.pool = pool
        self._copy_block = copy_block
        self.row: list[int] = []
        """Row 0's blocks: block i holds positions ``i*BLOCK_SIZE ..``."""
        self._extra_rows: list[list[int]] = []  # rows 1.. during a beam search
        self.length = 0
        """Positions the rows hold (the runner sets it once a feed has run)."""

    @property
    def rows(self) -> list[list[int]]:
        """Every row's blocks, row 0 first (``table.rows[0] is table.row``)."""
        return [self.row, *self._extra_rows]

    def private_blocks(self) -> int:
        """Blocks no other table holds (a cached prefix, a fork): what emptying the table frees
        (``table.private_blocks()``)."""
        held = Counter(block for row in self.rows for block in row)
        return sum(1 for block, count in held.items() if self.pool.holders(block) == count)

    # ---- growing ---------------------------------------------------------------------------
    def prepare_write(self, row: list[int], past_len: int, tokens: int) -> None:
        """Make ``row`` ready for ``tokens`` positions written after ``past_len``: the block the
        write starts in becomes private (copy-on-write; only the first can be shared), and blocks
        are added to cover ``past_len + tokens`` (``KVPoolExhausted``: none taken, nothing changed)."""
        self._own_block(row, past_len)
        self.grow(row, past_len + tokens)

    def grow(self, row: list[int], tokens: int) -> None:
        """Add blocks to ``row`` until it covers ``tokens`` positions."""
        missing = blocks_for(tokens) - len(row)
        if missing > 0:
            row.extend(self.pool.allocate(missing, holder=self))

    def try_grow(self, tokens: int) -> bool:
        """``grow`` row 0 from the free blocks; False (nothing taken) when none is free."""
        try:
            self.grow(self.row, tokens)
        except KVPoolExhausted:
            return False
        return True

    def _own_block(self, row: list[int], position: int) -> None:
        index = position // BLOCK_SIZE
        if index < len(row) and self.pool.holders(row[index]) > 1:
            [copy] = self.pool.allocate(1, holder=self)
            self._copy_block(row[index], copy)
            self.pool.release([row[index]])
            row[index] = copy

    def branch_rows(self, parents: list[int], past_len: int, tokens: int) -> None:
        """Replace the rows by one per ``parents`` entry, each starting as a share of that parent
        row and made ready for ``tokens`` positions after ``past_len`` (a beam step: rows hold
        common blocks until they write into them). On failure the old rows are kept."""
        rows = self.rows
        if not all(0 <= p < len(rows) for p in parents):
            raise UserError(f"beam_idx {parents} does not pick rows of the slot's {len(rows)} rows")
        new_rows: list[list[int]] = []
        try:
            for parent in parents:
                row = list(rows[parent])
                self.pool.share(row)
                new_rows.append(row)
                self.prepare_write(row, past_len, tokens)
        except BaseException:
            for row in new_rows:
                self.pool.release(row)
            raise
        for row in rows:
            self.pool.release(row)
        self.row, self._extra_rows = new_rows[0], new_rows[1:]

    # ---- shrinking -------------------------------------------------------------------------
    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions; blocks past them go back to the pool."""
        if n >= self.length:
            return
        keep = blocks_for(n)
        for row in self.rows:
            self.pool.release(row[keep:])
            del row[keep:]
        self.length = n

    def select_row(self, index: int, n: int) -> None:
        """Keep only row ``index`` and its first ``n`` positions."""
        rows = self.rows
        if not 0 <= index < len(rows):
            raise UserError(f"row {index} is not one of the slot's {len(rows)} rows")
        for i, row in enumerate(rows):
            if i != index:
                self.pool.release(row)
        self.row, self._extra_rows = rows[index], []
        self.trim(n)

    def release_rows(self) -> None:
        """Let go of every row's blocks, keeping the reservation (a write that fills the table next)."""
        for row in self.rows:
            self.pool.release(row)
        self.row, self._extra_rows, self.length = [], [], 0

    def reset(self) -> None:
        """Empty the table: its blocks go back to the pool, and so does what the pool still had
        reserved for it (the slot is offloaded, released, or its step failed)."""
        self.release_rows()
        self.pool.unreserve(self)

    def attach(self, blocks: list[int], length: int) -> None:
        """Make ``blocks`` (references already held for this table) row 0, holding ``length``
        positions: how a shared prefix or a fork's KV is used without a copy."""
        if blocks_for(length) != len(blocks):
            raise UserError(f"{len(blocks)} blocks cannot hold exactly {length} positions")
        self.release_rows()
        self.row, self.length = list(blocks), length
