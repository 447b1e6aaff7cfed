"""BlockPool: the KV blocks of a paged model — a free list and a reference count per block.

A block shared by several block tables (a cached prefix, a fork) returns to the free list when
its last holder releases it; a block is never both free and held. Thread-safe::

    pool = BlockPool(256)
    table = pool.allocate(4)          # four fresh blocks, each held once
    pool.share(table[:2])             # a second table points at the first two
    pool.release(table)               # blocks 2, 3 are free again; 0, 1 still held once

Whoever made room for a step reserves the free blocks the step takes (``reserve``), so sessions
that make room at the same time and then allocate together in one batched step each get what
they made room for: a holder's allocations draw on its reservation first, everyone else only
on the free blocks nobody reserved::

    if pool.reserve(slot, 2):         # two free blocks set aside for ``slot``
        table = pool.allocate(2, holder=slot)
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Hashable, Sequence

from agentkv.errors import KVPoolCorrupt, KVPoolExhausted, UserError

BLOCK_SIZE = 32
"""Tokens per KV block (the CPU plugin's PagedAttention block): what a table's block holds."""


class BlockPool:
    """``num_blocks`` blocks, each free or held by one or more block tables."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise UserError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._reserved: dict[Hashable, int] = {}  # holder -> free blocks set aside for it
        self._reserved_total = 0
        self._lock = threading.Lock()

    @property
    def free_blocks(self) -> int:
        """Blocks nobody holds (reserved ones included)."""
        return len(self._free)

    @property
    def unreserved_blocks(self) -> int:
        """Free blocks no reservation sets aside: what an allocation without one can take."""
        return len(self._free) - self._reserved_total

    @property
    def reserved_blocks(self) -> int:
        """Free blocks reservations set aside, all holders together: ``pool.reserved_blocks``."""
        return self._reserved_total

    def reserved(self, holder: Hashable) -> int:
        """Free blocks set aside for ``holder`` now: ``pool.reserved(slot)``."""
        return self._reserved.get(holder, 0)

    def reserve(self, holder: Hashable, n: int) -> bool:
        """Set ``n`` free blocks aside for ``holder``'s next allocations (replacing what it had
        reserved); False, and nothing changed, if fewer than ``n`` are free and unreserved
        (counting its own): ``pool.reserve(slot, 2)``. O(1)."""
        with self._lock:
            had = self._reserved.get(holder, 0)
            if n - had > len(self._free) - self._reserved_total:
                return False
            self._set_reserved(holder, n)
            return True

    def unreserve(self, holder: Hashable) -> None:
        """Give back what is still set aside for ``holder`` (a step that did not run, a slot emptied)."""
        with self._lock:
            self._set_reserved(holder, 0)

    def _set_reserved(self, holder: Hashable, n: int) -> None:
        self._reserved_total += n - self._reserved.pop(holder, 0)
        if n:
            self._reserved[holder] = n

    def allocate(self, n: int, holder: Hashable | None = None) -> list[int]:
        """``n`` free blocks, now held once each, drawn first from what is reserved for
        ``holder``, then from the unreserved ones; ``KVPoolExhausted`` (nothing taken) if that
        is too few. It only allocates: whoever is about to allocate makes room first (the paged
        backend's ``make_room``: cached prefixes, idle sessions to host, then ``reserve``)."""
        with self._lock:
            own = self._reserved.get(holder, 0) if holder is not None else 0
            usable = len(self._free) - self._reserved_total + own
            if n > usable:
                raise KVPoolExhausted(
                    f"{n} KV blocks needed, {usable} of {self.num_blocks} free after the engine made room "
                    "(cached prefixes evicted, idle sessions moved to host); shorten the prompt, close sessions "
                    "that are running, or give the engine more kv_cache_bytes"
                )
            if own:
                self._set_reserved(holder, own - min(own, n))
            blocks = [self._free.popleft() for _ in range(n)]
            for block in blocks:
                self._refs[block] = 1
            return blocks

    def share(self, blocks: Sequence[int]) -> None:
        """Hold ``blocks`` once more (each must be held already)."""
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise UserError(f"block {block} is free: only held blocks can be shared")
            for block in blocks:
                self._refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Let go of ``blocks`` once; a block nobody holds any more becomes free."""
        with self._lock:
            for block in blocks:
                if self._refs[block] < 1:
                    raise UserError(f"block {block} released more often than it was held")
                self._refs[block] -= 1
                if self._refs[block] == 0:
                    self._free.append(block)

    def holders(self, block: int) -> int:
        """How many block tables hold ``block`` (0: free)."""
        return self._refs[block]

    def check_integrity(self) -> None:
        """Raise ``KVPoolCorrupt`` unless every block is either free (0 holders) or held, and on
        the free list at most once (checked under ``python -O`` too)."""
        with self._lock:
            free = set(self._free)
            if len(free) != len(self._free):
                raise KVPoolCorrupt(f"a block is on the free list twice ({len(self._free)} entries, "
                                    f"{len(free)} blocks); a bug in agentkv: report it")
            for block, refs in enumerate(self._refs):
                if (refs == 0) != (block in free):
                    raise KVPoolCorrupt(f"block {block} has {refs} holders but free={block in free}; "
                                        "a bug in agentkv: report it", block=block)
            if self._reserved_total != sum(self._reserved.values()) or self._reserved_total > len(free):
                raise KVPoolCorrupt(f"{self._reserved_total} blocks reserved with {len(free)} free; "
                                    "a bug in agentkv: report it")
