"""PagedPrefixCache: registered prefixes held as shared KV blocks — a hit points at them, no copy.

On the paged engine a prefix's KV already sits in blocks. Once a session has read a registered
prefix (system prompt + tool schemas), the cache takes a reference on the blocks that hold it;
a later session that starts with the prefix gets a block table pointing at the same blocks and
prefills only what follows. The last, partly filled block is shared too: whoever writes into a
shared block first copies it (``BlockTable``'s copy-on-write), so cached KV never changes. An
entry keeps the cuts of the KV it shares (where the session's passes began), and a hit carries them::

    cache = PagedPrefixCache(pool, boundaries=engine.boundaries, max_blocks=64, block_bytes=model.block_bytes)
    await cache.capture(session, slot)             # after a prefill: share the prefixes it covers
    hit = cache.lookup(prompt, longer_than=10)     # SharedBlocks (references held), or None
    hit.write_into(slot)                           # the slot's table now starts with its blocks

Entries are evicted least recently used first when the cache exceeds ``max_blocks`` distinct
blocks, and when the pool runs short (the paged backend calls ``reclaim`` before a step). Evicting an entry only
drops the cache's reference: blocks sessions still point at stay theirs. Thread-safe.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVSlot
from agentkv.engine.paged.block_pool import BLOCK_SIZE
from agentkv.engine.paged.block_table import blocks_for, table_of
from agentkv.engine.paged.shared_blocks import SharedBlocks
from agentkv.engine.prefix.kv_chunks import captured_cuts
from agentkv.engine.prefix.stats import CapturableSession, PrefixCacheStats
from agentkv.kv.snapshot_cuts import Cuts
from agentkv.errors import UserError


class PagedPrefixCache:
    """Registered prefix → the blocks holding its KV, LRU. See the module docstring for a call."""

    def __init__(
        self, pool: BlockPool, *, boundaries: PrefixBoundaries, max_blocks: int | None, block_bytes: int,
        exact_partial_blocks: bool = True,
    ) -> None:
        """``exact_partial_blocks=False``: a hit ending inside a block is not bit-exact (a u8 cache
        re-quantises a block's keys as later tokens join it), and says so (``lossless``)."""
        if max_blocks is not None and max_blocks < 0:
            raise UserError(f"max_blocks must be >= 0 or None (unbounded), got {max_blocks}")
        self.pool = pool
        self.boundaries = boundaries
        self.max_blocks = max_blocks
        self.block_bytes = block_bytes
        self.exact_partial_blocks = exact_partial_blocks
        self._lock = threading.Lock()
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], tuple[int, ...]] = OrderedDict()  # LRU first
        self._cuts: dict[tuple[str, tuple[int, ...]], Cuts] = {}  # where each entry's KV passes began
        self._counts = dict.fromkeys(("hits", "misses", "hit_tokens", "inserted_tokens", "evictions",
                                      "evicted_bytes"), 0)

    # ---- capture ---------------------------------------------------------------------
    async def capture(self, session: CapturableSession, slot: KVSlot, *, salt: str = "") -> int:
        """Share the blocks of every registered prefix ``session`` now holds and the cache lacks
        (the caller holds the session's lease on ``slot``). Returns the tokens newly cached."""
        table = table_of(slot)
        if session.shifted or not session.kv_exact or table is None:
            return 0
        tokens = session.tokens
        added = 0
        for mark in self.boundaries.prefixes_of(tokens, salt=salt):
            key = (salt, mark)
            with self._lock:
                if key in self._entries:
                    continue
                blocks = tuple(table.row[: blocks_for(len(mark))])
                self.pool.share(blocks)
                self._entries[key] = blocks
                self._cuts[key] = captured_cuts(session, len(mark))
                self._counts["inserted_tokens"] += len(mark)
                added += len(mark)
                self._fit_budget(protect=key)
        return added

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, prompt: Sequence[int], *, longer_than: int = 0, salt: str = "") -> SharedBlocks | None:
        """The longest cached prefix of ``prompt`` longer than ``longer_than`` and shorter than
        ``prompt``, holding a reference on its blocks (use it or ``release`` it); else None."""
        key = tuple(int(t) for t in prompt)
        with self._lock:
            best = None
            for (entry_salt, mark) in self._entries:
                if entry_salt == salt and longer_than < len(mark) < len(key) and key[: len(mark)] == mark:
                    if best is None or len(mark) > len(best):
                        best = mark
            if best is None:
                self._counts["misses"] += 1
                return None
            blocks = self._entries[(salt, best)]
            self._entries.move_to_end((salt, best))
            self.pool.share(blocks)
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += len(best) - max(0, longer_than)
            exact = self.exact_partial_blocks or len(best) % BLOCK_SIZE == 0
            return SharedBlocks(self.pool, best, blocks, lossless=exact, cuts=self._cuts.get((salt, best)))

    def match_len(self, tokens: Sequence[int], *, salt: str = "") -> int:
        """How many leading tokens of ``tokens`` a cached prefix covers (no stats, no LRU touch)."""
        key = tuple(int(t) for t in tokens)
        with self._lock:
            return max((len(m) for (s, m) in self._entries if s == salt and key[: len(m)] == m), default=0)

    # ---- eviction --------------------------------------------------------------------
    def reclaim(self, blocks_needed: int | Callable[[], int]) -> None:
        """Drop least recently used entries until the pool has ``blocks_needed`` free blocks no
        reservation sets aside, or the cache is empty (the paged backend's ``make_room``, before
        a step that allocates): ``cache.reclaim(4)``. A function is counted again after each
        eviction (a step rewriting or copying blocks the cache shared then needs fewer)."""
        count = blocks_needed if callable(blocks_needed) else lambda: blocks_needed
        with self._lock:
            while self._entries and self.pool.unreserved_blocks < count():
                self._evict_oldest()

    def clear(self) -> None:
        """Drop every entry (blocks sessions still point at stay theirs)."""
        with self._lock:
            while self._entries:
                self._evict_oldest()

    def _fit_budget(self, protect: tuple[str, tuple[int, ...]]) -> None:
        while self.max_blocks is not None and len(self._distinct_blocks()) > self.max_blocks:
            oldest = next(iter(self._entries))
            if oldest == protect:
                if len(self._entries) == 1:
                    self._evict_oldest()  # the prefix alone is bigger than the budget
                    return
                self._entries.move_to_end(protect)
                continue
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        key, blocks = self._entries.popitem(last=False)
        self._cuts.pop(key, None)
        freed = len(set(blocks) - self._distinct_blocks())
        self.pool.release(blocks)
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += freed * self.block_bytes

    def _distinct_blocks(self) -> set[int]:
        return {b for blocks in self._entries.values() for b in blocks}

    def entries(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """(prefix tokens, its blocks) of every entry, least recently used first (a copy)."""
        with self._lock:
            return [(mark, blocks) for (_, mark), blocks in self._entries.items()]

    def stats(self) -> PrefixCacheStats:
        """Counters since the cache was made, and its size now (bytes of distinct cached blocks)."""
        with self._lock:
            return PrefixCacheStats(
                bytes=len(self._distinct_blocks()) * self.block_bytes,
                budget_bytes=None if self.max_blocks is None else self.max_blocks * self.block_bytes,
                nodes=len(self._entries), **self._counts,
            )
