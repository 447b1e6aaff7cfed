"""BlockPool: the KV blocks of a paged model — a free list and a reference count per block.

A block shared by several block tables (a cached prefix, a fork) returns to the free list when
its last holder releases it; a block is never both free and held. Thread-safe::

    pool = BlockPool(256)
    table = pool.allocate(4)          # four fresh blocks, each held once
    pool.share(table[:2])             # a second table points at the first two
    pool.release(table)               # blocks 2, 3 are free again; 0, 1 still held once
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence

from agentkv.errors import KVPoolCorrupt, KVPoolExhausted, UserError


class BlockPool:
    """``num_blocks`` blocks, each free or held by one or more block tables."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise UserError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._lock = threading.Lock()
        self.reclaim: Callable[[int], None] | None = None
        """Called with the blocks wanted when an allocation finds too few free (blocking)."""

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, now held once each; ``KVPoolExhausted`` (nothing taken) if fewer are
        free even after the ``reclaim`` hook (e.g. the prefix cache letting go) had its chance."""
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n)  # NOTE: outside our lock: it releases blocks
        with self._lock:
            if n > len(self._free):
                raise KVPoolExhausted(
                    f"{n} KV blocks needed, {len(self._free)} of {self.num_blocks} free even after reclaiming "
                    "(cached prefixes, idle sessions to host); shorten the prompt, close sessions that are "
                    "running, or give the engine more kv_cache_bytes"
                )
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
