"""PagedBackend: the ``SlotBackend`` of the paged engine — KV in shared blocks, room made before a step.

What differs from a backend whose slots own their storage: a u8 cache's snapshots are its raw
blocks (bit-exact), a fork holds references on its parent's blocks (``SharedBlocks``, nothing
copied), cached prefixes stay in the pool's blocks (``PagedPrefixCache``), and before a step that
takes blocks the async code makes room (``room`` around the step): cached prefixes go first, then
forks that have not run move to host, then idle sessions are offloaded, least recently used first,
and the freed blocks are reserved for the slot that made room (sessions decoding together make
room one by one, then allocate together in one batched step); what the step did not take goes
back after it. A step that rewrites the KV (a restore, a span drop) counts the blocks it shares
as taken anew. The block pool itself only reserves, allocates or refuses::

    backend = PagedBackend(model, BlockPool(model.num_blocks), slots=[...], tokenizer=tok, ...)
    async with backend.room(slot, len(ids)):       # room for the feed that takes the blocks
        await backend.run_blocking(log.feed, slot, ids)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import numpy as np

from agentkv.engine.paged.block_io import read_raw_blocks, read_table, read_table_stored
from agentkv.engine.paged.block_pool import BLOCK_SIZE, BlockPool
from agentkv.engine.paged.block_table import BlockTable, blocks_for, table_of
from agentkv.engine.paged.model import PagedModel
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.shared_blocks import SharedBlocks
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.backend import OpenSession, SlotBackend
from agentkv.errors import KVLogCorrupt
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.kv.snapshot import RAW_BLOCKS, KVSnapshot, PrecisionChoice
from agentkv.kv.snapshot_cuts import span_cuts

if TYPE_CHECKING:
    from anyio.lowlevel import EventLoopToken


def _cuts(cuts: Sequence[int] | None) -> tuple[int, ...] | None:
    """A log's cuts as a snapshot keeps them (None: unknown)."""
    return None if cuts is None else tuple(cuts)


class PagedBackend(SlotBackend):
    """Block tables over one ``BlockPool`` of a ``PagedModel``; see the module docstring."""

    def __init__(self, model: PagedModel, block_pool: BlockPool, **options: Any) -> None:
        """``options``: as ``SlotBackend`` (slots, tokenizer, fingerprint, …). With a u8 cache,
        ``snapshot_precision`` "auto" or "u8" keeps snapshots as raw blocks."""
        self.paged_model = model
        self.block_pool = block_pool
        """The KV blocks every session's table draws from."""
        super().__init__(**options)
        self._raw_snapshots = model.kv_cache_precision == "u8" and self.snapshot_precision in ("auto", "u8")

    # ---- KV: snapshots, holds, restores ------------------------------------------------
    def snapshot(self, log: KVLog, slot: KVSlot, start: int = 0) -> KVSnapshot:
        """Host snapshot of ``log``'s KV in ``slot``: a u8 cache's raw blocks (bit-exact, u8 size),
        a 16-bit cache's values as they are stored (no float32 pass, no precision probe: they are
        lossless in it), else floats in the snapshot precision (blocking): ``backend.snapshot(log, slot)``.
        ``start`` (a multiple of the block: only those blocks are read): of the tokens from there on."""
        stored = self.paged_model.kv_cache_precision
        as_stored = stored in ("f16", "bf16") and self.snapshot_precision in ("auto", stored)
        if not (self._raw_snapshots or as_stored) or start % BLOCK_SIZE:
            return super().snapshot(log, slot, start)
        table = table_of(slot)
        assert table is not None
        if slot.length() != len(log):
            raise KVLogCorrupt(f"the slot holds {slot.length()} positions but the log has {len(log)} tokens")
        tokens = tuple(log.tokens[start:])
        cuts = span_cuts(_cuts(log.cuts), start, len(log)) if start else _cuts(log.cuts)
        first = start // BLOCK_SIZE
        if as_stored:
            keys, values = read_table_stored(self.paged_model, table.row[first:], len(log) - start)
            if stored == "bf16":  # the snapshot's bf16 storage is the values' bits
                return KVSnapshot(tokens=tokens, keys=keys.view(np.uint16), values=values.view(np.uint16),
                                  precision="bf16", fingerprint=self.fingerprint, shifted=log.shifted,
                                  lossless=log.exact, cuts=cuts)
            return KVSnapshot(tokens=tokens, keys=keys.astype(np.float16, copy=False),
                              values=values.astype(np.float16, copy=False), precision="f16",
                              fingerprint=self.fingerprint, shifted=log.shifted, lossless=log.exact, cuts=cuts)
        blocks = table.row[first: blocks_for(len(log))]  # a failed feed may have grown the table already
        return self._raw_snapshot(tokens, blocks, shifted=log.shifted, lossless=log.exact, cuts=cuts)

    def _raw_snapshot(self, tokens: Sequence[int], blocks: Sequence[int], *, shifted: bool,
                      lossless: bool, cuts: Sequence[int] | None) -> KVSnapshot:
        keys, values = read_raw_blocks(self.paged_model, blocks)
        return KVSnapshot.from_blocks(tokens, keys, values, block_tokens=BLOCK_SIZE, fingerprint=self.fingerprint,
                                      shifted=shifted, lossless=lossless, cuts=cuts)

    def restores_exactly(self, source: KVSource) -> bool:
        """Raw blocks and shared blocks give back the very bytes; floats as on any backend."""
        if isinstance(source, SharedBlocks) or getattr(source, "precision", None) == RAW_BLOCKS:
            return source.lossless
        return super().restores_exactly(source)

    def hold(self, log: KVLog, slot: KVSlot, *, salt: str = "") -> SharedBlocks:
        """A fork's copy of ``log``'s KV: references on the same blocks (no KV copied; the
        first write into a shared block copies that block): ``held = backend.hold(log, slot)``."""
        table = table_of(slot)
        assert table is not None
        blocks = list(table.row)
        self.block_pool.share(blocks)
        return SharedBlocks(self.block_pool, log.tokens, blocks, shifted=log.shifted, lossless=log.exact,
                            cuts=log.cuts, read=self.snapshot_of_shared)

    def snapshot_of_shared(self, shared: SharedBlocks) -> KVSnapshot:
        """Host snapshot of blocks a fork holds (blocking): ``SharedBlocks(..., read=backend.snapshot_of_shared)``."""
        if self._raw_snapshots:
            return self._raw_snapshot(shared.tokens, shared.blocks, shifted=shared.shifted, lossless=shared.lossless,
                                      cuts=shared.cuts)
        keys, values = read_table(self.paged_model, shared.blocks, shared.num_tokens)
        return self.snapshot_of(shared.tokens, keys, values, shifted=shared.shifted, lossless=shared.lossless,
                                cuts=shared.cuts)

    def _make_prefix_cache(self, budget_bytes: int | None, precision: PrecisionChoice) -> PagedPrefixCache:
        """Cached prefixes stay in the pool's blocks (``precision`` does not apply: nothing is
        converted); ``budget_bytes`` caps the blocks the cache alone keeps alive."""
        block = self.paged_model.block_bytes
        # NOTE: the plugin re-quantises a u8 block's keys as tokens join it, so there the last,
        # partly filled block of a prefix captured later is not what a cold prefill leaves
        return PagedPrefixCache(self.block_pool, boundaries=self.boundaries, block_bytes=block,
                                max_blocks=None if budget_bytes is None else budget_bytes // block,
                                exact_partial_blocks=self.paged_model.kv_cache_precision != "u8")

    # ---- room for new KV -----------------------------------------------------------------
    @asynccontextmanager
    async def room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1, rewrite: bool = False
                   ) -> AsyncIterator[None]:
        """Room for the one blocking step run inside: ``make_room`` (``make_room_to_rewrite``)
        before it, and what the step did not take of the reservation goes back after it, also
        when the call is cancelled before the step starts. O(1) and lock-free when the step
        takes no new block (most decode steps)::

            async with backend.room(slot, len(ids)):
                await backend.run_blocking(log.feed, slot, ids)

        ``rewrite``: the step replaces the slot's KV by ``tokens`` positions (a restore, a span drop)."""
        if self.blocks_needed(slot, tokens, rows=rows, rewrite=rewrite) == 0:
            self._give_back(slot)  # left over by a step that did not run
            yield
            return
        try:
            if rewrite:
                await self.make_room_to_rewrite(slot, tokens)
            else:
                await self.make_room(slot, tokens, rows=rows)
            yield
        finally:
            self._give_back(slot)

    @contextmanager
    def room_blocking(self, slot: KVSlot | None, tokens: int, *, token: EventLoopToken,
                      before_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """``room`` for a step a worker thread runs: free blocks are reserved from the thread (the
        pool is thread-safe); only when none are left does ``make_room`` run on the event loop
        (``token``) to evict for them, the thread waiting (after ``before_wait()``)::

            with backend.room_blocking(slot, len(ids), token=loop_token):
                log.feed(slot, ids)
        """
        needed = self.blocks_needed(slot, tokens)
        if needed == 0:
            self._give_back(slot)  # left over by a step that did not run
            yield
            return
        try:
            if not self._reserve(table_of(slot), needed):
                if before_wait is not None:
                    before_wait()
                anyio.from_thread.run(self.make_room, slot, tokens, token=token)
            yield
        finally:
            self._give_back(slot)

    def lease_ended(self, slot: KVSlot) -> None:
        """The step batcher stops waiting for ``slot``'s next feed: ``backend.lease_ended(slot)``."""
        if isinstance(slot, PagedSlot) and slot.batcher is not None:
            slot.batcher.forget(slot)

    def _give_back(self, slot: KVSlot | None) -> None:
        """Return what ``slot`` reserved and no step took (thread-safe)."""
        table = table_of(slot)
        if table is not None and self.block_pool.reserved(table):
            self.block_pool.unreserve(table)

    async def make_room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1) -> None:
        """Free and reserve for ``slot`` the blocks it takes to hold ``tokens`` more positions
        on ``rows`` rows: the prefix cache lets go first, then forks that have not run move to
        host, then idle sessions are offloaded, least recently used first, until the pool can
        set them aside for ``slot`` (its step then draws on them, whoever else allocates in the
        same batched step) or nobody idle is left (the allocation then refuses). The
        reservation stays until a step takes it or the slot is emptied: ``room`` pairs it with
        its step::

            await backend.make_room(slot, len(ids))

        ``slot`` None (nothing to reserve for): frees the blocks only."""
        await self._make_room_for(slot, lambda: self.blocks_needed(slot, tokens, rows=rows), rewrite=False)

    async def make_room_to_rewrite(self, slot: KVSlot | None, length: int) -> None:
        """``make_room`` for a step that replaces ``slot``'s KV by ``length`` positions (a
        restore, a span drop): the blocks only this slot holds go back first, the ones it shares
        (a cached prefix, a fork) stay, so it may take up to all of the new blocks::

            await backend.make_room_to_rewrite(slot, len(snapshot.tokens))
        """
        await self._make_room_for(slot, lambda: self.blocks_needed(slot, length, rewrite=True), rewrite=True)

    async def _make_room_for(self, slot: KVSlot | None, needed: Callable[[], int], *, rewrite: bool) -> None:
        """Free and reserve ``needed()`` blocks (counted again after each eviction: one can make
        a step need fewer, the blocks it rewrites or copies being no longer shared)."""
        holder = table_of(slot)
        if self._reserve(holder, needed()):
            return
        if isinstance(self.prefix_cache, PagedPrefixCache):
            self.prefix_cache.reclaim(lambda: needed() - self.block_pool.reserved(holder))
            if self._reserve(holder, needed()):
                return
        await self._spill_unbound_forks(holder, needed, rewrite=rewrite)
        while not self._reserve(holder, needed()):
            if not await self.pool.offload_idle():
                return

    def _reserve(self, holder: BlockTable | None, needed: int) -> bool:
        """Set ``needed`` blocks aside for ``holder`` (None: only check that they are free)."""
        if holder is None:
            return self.block_pool.unreserved_blocks >= needed
        return self.block_pool.reserve(holder, needed)

    def blocks_needed(self, slot: KVSlot | None, tokens: int, *, rows: int = 1, rewrite: bool = False) -> int:
        """Fresh blocks a step that adds ``tokens`` positions on ``rows`` rows of ``slot`` takes:
        the blocks it grows by, plus the copy of a shared block it writes into
        (``backend.blocks_needed(slot, 1)``). ``rewrite``: a step that replaces the KV by
        ``tokens`` positions takes their blocks less those only this slot holds (freed first)."""
        held = table_of(slot)
        if held is None:
            return rows * blocks_for(tokens)
        if rewrite:
            return max(0, blocks_for(tokens) - held.private_blocks())
        length, table = held.length, held.row
        grow = max(0, blocks_for(length + tokens) - len(table))
        index = length // BLOCK_SIZE
        # NOTE: a feed on a beam's rows (or onto one of them, its end) starts each row as a share
        # of its parent's table, so each copies the block it writes into
        beam = rows > 1 or len(held.rows) > 1
        shared = index < len(table) and (beam or self.block_pool.holders(table[index]) > 1)
        return rows * (grow + int(shared and tokens > 0))

    async def _spill_unbound_forks(self, holder: BlockTable | None, needed: Callable[[], int], *,
                                   rewrite: bool) -> None:
        """Move to host the KV of sessions that hold blocks without a slot (forks that have not
        run) and are the blocks' last holders (``rewrite``: but for ``holder``, which lets go of
        its own), those freeing the most first, until ``holder``'s ``needed()`` blocks can be set aside."""
        own = Counter(b for row in holder.rows for b in row) if rewrite and holder is not None else Counter()

        def gain(session: OpenSession) -> int:
            held = session.held_kv
            if not isinstance(held, SharedBlocks):
                return 0
            return sum(1 for b in set(held.blocks) if self.block_pool.holders(b) == 1 + own[b])

        for session in sorted(self.sessions, key=gain, reverse=True):
            short = needed() - self.block_pool.reserved(holder) - self.block_pool.unreserved_blocks
            if short <= 0 or gain(session) == 0:
                return
            await session.spill_held_blocks()
