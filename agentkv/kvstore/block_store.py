"""The KV store's blocks: a snapshot saved as its new keyed blocks, a restore as the longest run the tiers hold.

Tiers are ordered fastest first (host memory, local disk, an S3 bucket: ``kvstore/block_tiers.py``,
``block_files.py``, ``block_objects.py``). A save puts each block the store has not seen into the
tiers that live in this process at once and queues it for the persistent ones (``WriteBehind``: off
the turn's critical path); a block already stored — the previous turn's history, a system prompt
another conversation wrote — is not written again. A load asks every tier for the blocks it still
misses (S3 in parallel), verifies each against its key (``kv/block_codec.py``), stops at the first
block nobody holds and copies what slower tiers gave into the faster ones::

    store = BlockStore([HostBlocks(256 << 20), DiskBlocks(Path("/srv/kv/blocks"))])
    saved = store.save(snapshot, space.chain(snapshot.tokens, cuts=snapshot.cuts))
    spans = store.load(space, chain.keys).spans  # the leading run of blocks, as spans
    store.close()                                # waits for queued blocks (bounded)

What a crash loses is what the queue held: the next restore takes the leading run and the
conversation re-prefills the rest from its history in SQL (the source of truth). A snapshot save
waits for its new blocks (``wait_written``, bounded) before its row names them, so a row written by
a process that then exits cleanly or is killed never names blocks that were still queued.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from cachetools import TTLCache

from agentkv.errors import UserError
from agentkv.kv.block_codec import BlockCorrupt, decode_block, encode_block
from agentkv.kv.block_keys import BlockChain, KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kvstore.block_tiers import BlockTier, BlockTierUnavailable, TierUsage
from agentkv.kvstore.write_behind import WriteBehind, WriteBehindUsage

__all__ = ["DURABLE_WAIT_S", "BlockStore", "BlockStoreUsage", "BlocksSaved", "KNOWN_TTL", "LoadedBlocks"]

logger = logging.getLogger("agentkv.store")

DURABLE_WAIT_S = 10.0
"""How long ``save_durably`` waits for new blocks to reach the persistent tiers (past it the caller
goes on: a crash before they land costs their re-prefill)."""
DEFAULT_PENDING_BYTES = 256 << 20
"""The most block bytes queued for the persistent tiers before a save waits (back-pressure)."""
KNOWN_TTL = timedelta(minutes=4)
"""How long a block this process wrote or read counts as stored without asking the tiers: shorter
than the collector's grace for unreferenced blocks (``memory/store.py``'s ``ORPHAN_GRACE``), so a
block the collector may have removed since is written again."""
_KNOWN_MAX = 1 << 18


@dataclass(frozen=True)
class BlocksSaved:
    """What one ``BlockStore.save`` wrote."""

    blocks: int
    """Full blocks of the log."""
    new_blocks: int
    """Blocks written (or queued) because no tier was known to hold them."""
    new_bytes: int
    """Their encoded bytes."""
    new_keys: tuple[str, ...] = ()
    """Their keys (``BlockStore.wait_written(saved.new_keys)`` waits until they are persisted)."""


@dataclass(frozen=True)
class LoadedBlocks:
    """What one ``BlockStore.load`` gave back: ``loaded.tokens_by_tier()["s3"]``."""

    spans: list[KVSnapshot]
    """The leading run of blocks, verified, in log order."""
    tiers: tuple[str, ...]
    """The tier each span came from ("host", "disk", "s3")."""

    def tokens_by_tier(self) -> dict[str, int]:
        """Tokens of KV each tier gave: ``{"host": 64, "s3": 320}``."""
        out: dict[str, int] = {}
        for span, tier in zip(self.spans, self.tiers):
            out[tier] = out.get(tier, 0) + span.num_tokens
        return out


@dataclass(frozen=True)
class BlockStoreUsage:
    """Every tier's counters and the write-behind queue's: ``store.usage().tiers[0].hits``."""

    tiers: tuple[TierUsage, ...]
    write_behind: WriteBehindUsage | None
    corrupt_blocks: int
    """Blocks read that failed their checks (skipped, removed from the tier, re-prefilled)."""


class BlockStore:
    """Keyed KV blocks over ``tiers`` (fastest first; at least one). See the module docstring."""

    def __init__(self, tiers: Sequence[BlockTier], *, max_pending_bytes: int = DEFAULT_PENDING_BYTES,
                 write_workers: int = 2) -> None:
        if not tiers:
            raise UserError("a BlockStore needs at least one tier (e.g. HostBlocks(256 << 20))")
        self.tiers = tuple(tiers)
        """The tiers, fastest first."""
        self._near = tuple(t for t in self.tiers if not t.persistent)
        far = [t for t in self.tiers if t.persistent]
        self._behind = (WriteBehind(far, max_pending_bytes=max_pending_bytes, workers=write_workers,
                                    on_failure=self._not_persisted) if far else None)
        self._known: TTLCache[str, None] = TTLCache(maxsize=_KNOWN_MAX, ttl=KNOWN_TTL.total_seconds())
        self._pinned: Counter[str] = Counter()  # blocks live sessions' offloaded KV needs: never collected
        self._lock = threading.Lock()
        self._corrupt = 0
        self.closed = False
        """True once ``close`` ran (its writers stopped: a user of it goes elsewhere)."""

    # ---- writes ---------------------------------------------------------------------------
    def save(self, snapshot: KVSnapshot, chain: BlockChain, *, start: int = 0) -> BlocksSaved:
        """Store the full blocks of ``snapshot`` that ``chain`` keys (its tokens under its namespace)
        and no tier is known to hold. Blocking (near tiers written, far ones queued). The caller
        keeps the tail (``chain.tail``): it is no block. ``start`` (a block bound): ``snapshot`` is
        the span of the log from there (``kv.snapshot(start=)``); the blocks before it are taken as
        stored (``first_unknown`` chose it)."""
        size = chain.namespace.block_size
        if snapshot.cuts is None:
            raise UserError("this snapshot does not say where its KV's passes were cut (an older file): save it whole")
        if start % size or start + snapshot.num_tokens < chain.tokens_in(len(chain.keys)):
            raise UserError(f"the chain keys {len(chain.keys)} blocks but the snapshot holds tokens {start}.."
                            f"{start + snapshot.num_tokens}: chain the snapshot's own tokens, from a block bound")
        absolute = [c + start for c in snapshot.cuts]  # a span's cut 0 is a pass that began at ``start``
        encoded: list[tuple[str, bytes]] = []
        parent = chain.namespace.id
        for index, key in enumerate(chain.keys):
            if index * size >= start and not self._is_known(key):
                at = index * size
                encoded.append((key, encode_block(snapshot.span(at - start, at - start + size), key=key,
                                                  parent=parent, start=at, cuts=absolute)))
            parent = key
        self._put(encoded)
        return BlocksSaved(len(chain.keys), len(encoded), sum(len(data) for _, data in encoded),
                           tuple(key for key, _ in encoded))

    def save_durably(self, snapshot: KVSnapshot, chain: BlockChain, *, start: int = 0,
                     timeout: float = DURABLE_WAIT_S) -> BlocksSaved:
        """``save``, then wait (bounded: a slow tier delays, never fails) until the persistent tiers
        took the new blocks: what a save does before a row or an index names them, so nothing that
        names a block can outlive a queue a clean exit or a kill would lose."""
        saved = self.save(snapshot, chain, start=start)
        self.wait_written(saved.new_keys, timeout)
        return saved

    def first_unknown(self, keys: Sequence[str]) -> int:
        """The index of the first of ``keys`` no tier is known to hold (``len(keys)``: all are):
        a save reads the KV from that block on only (``kv.snapshot(start=index * block_size)``)."""
        return next((i for i, key in enumerate(keys) if not self._is_known(key)), len(keys))

    def wait_written(self, keys: Sequence[str], timeout: float | None = None) -> bool:
        """Wait until the persistent tiers have taken ``keys`` (written, or failed and counted):
        True, or False after ``timeout`` seconds. A save waits on its new blocks before its row
        names them, so a row never names blocks a clean exit could still lose."""
        return True if self._behind is None or not keys else self._behind.wait_for(keys, timeout)

    def _is_known(self, key: str) -> bool:
        if self._behind is None:  # NOTE: no persistent tier: only what memory still holds is stored
            return any(key in tier.has_many([key]) for tier in self._near)
        with self._lock:
            if key in self._known:
                return True
        held = any(key in tier.has_many([key]) for tier in self._near)
        if held:
            self._remember([key])
        return held

    def _not_persisted(self, key: str) -> None:
        """A persistent tier failed to write ``key``: forget it and drop it from the near tiers, so
        the next save that needs it queues it again (host memory must not hide a block no disk or
        bucket holds)."""
        with self._lock:
            self._known.pop(key, None)
        for tier in self._near:
            self._remove_quietly(tier, [key])

    def _remember(self, keys: Iterable[str]) -> None:
        with self._lock:
            for key in keys:
                self._known[key] = None

    def _put(self, blocks: Sequence[tuple[str, bytes]]) -> None:
        """Keep a chain's new blocks (in log order) in the near tiers and queue them for the far ones.
        NOTE: the near tiers get them last first, so a chain's first blocks — those other chains share,
        a system prompt — are its most recently used and leave an LRU tier last; the queue persists
        them first (a crash keeps the leading run a restore needs)."""
        for key, data in reversed(blocks):
            for tier in self._near:
                try:
                    tier.put(key, data)
                except BlockTierUnavailable as error:
                    logger.warning("KV block %s not kept in the %s tier: %s", key, tier.name, error)
        self._remember(key for key, _ in blocks)  # NOTE: before the queue: a failure reported at once must win
        for key, data in blocks:
            if self._behind is not None and not self._behind.submit(key, data):
                self._not_persisted(key)

    # ---- reads ----------------------------------------------------------------------------
    def load(self, namespace: KVNamespace, keys: Sequence[str]) -> LoadedBlocks:
        """The leading run of ``keys`` (a chain in ``namespace``, oldest first) the tiers hold, as
        verified spans (``len(loaded.spans)`` blocks, each ``namespace.block_size`` tokens) and the
        tier each came from. A block that fails its checks is removed from the tier that gave it,
        logged, and ends the run."""
        wanted = list(keys)
        found: dict[str, tuple[bytes, BlockTier]] = {}
        for tier in self.tiers:
            missing = [k for k in wanted if k not in found]
            if not missing:
                break
            for key, data in tier.get_many(missing).items():
                found[key] = (data, tier)
        spans: list[KVSnapshot] = []
        sources: list[str] = []
        promoted: list[tuple[str, bytes, BlockTier]] = []
        parent = namespace.id
        for index, key in enumerate(wanted):
            if key not in found:
                break
            data, tier = found[key]
            try:
                spans.append(decode_block(data, key=key, parent=parent, start=index * namespace.block_size,
                                          namespace=namespace))
            except BlockCorrupt as error:
                logger.warning("%s (from the %s tier)", error, tier.name)
                with self._lock:
                    self._corrupt += 1
                    self._known.pop(key, None)
                self._remove_quietly(tier, [key])
                break
            parent = key
            sources.append(tier.name)
            promoted.append((key, data, tier))
        for key, data, tier in reversed(promoted):  # NOTE: last first, as ``_put``: the shared first blocks stay
            self._promote(key, data, tier)
        self._remember(wanted[:len(spans)])
        return LoadedBlocks(spans, tuple(sources))

    def _promote(self, key: str, data: bytes, source: BlockTier) -> None:
        """Copy a block a slower tier gave into the near tiers faster than it."""
        for tier in self._near:
            if tier is source:
                return
            try:
                tier.put(key, data)
            except BlockTierUnavailable:
                return

    # ---- collection -----------------------------------------------------------------------
    def collect(self, referenced: set[str], *, older_than: timedelta, now: datetime | None = None) -> int:
        """Remove, from every tier, blocks no key in ``referenced`` names that were written more than
        ``older_than`` ago (a save writes its blocks before its row); returns the bytes freed.
        Blocks still queued are never listed, so never removed."""
        cutoff = (now or datetime.now(timezone.utc)) - older_than
        with self._lock:
            kept = referenced | set(self._pinned)
        freed = 0
        for tier in self.tiers:
            try:
                stale = [b.key for b in tier.listing() if b.key not in kept and b.modified < cutoff]
            except BlockTierUnavailable as error:
                logger.warning("could not list the %s tier's KV blocks to collect them: %s", tier.name, error)
                continue
            if stale:
                freed += self._remove_quietly(tier, stale)
                with self._lock:
                    for key in stale:
                        self._known.pop(key, None)
        return freed

    @staticmethod
    def _remove_quietly(tier: BlockTier, keys: list[str]) -> int:
        """``tier.remove(keys)``; a tier that cannot be reached now is logged (the next collection retries)."""
        try:
            return tier.remove(keys)
        except BlockTierUnavailable as error:
            logger.warning("could not remove %d KV block(s) from the %s tier: %s", len(keys), tier.name, error)
            return 0

    def pin(self, keys: Iterable[str]) -> None:
        """Keep ``keys`` out of ``collect`` until as many ``unpin`` calls (an offloaded session's
        blocks: no row names them, a live session needs them): ``store.pin(receipt.keys)``."""
        with self._lock:
            self._pinned.update(keys)

    def unpin(self, keys: Iterable[str]) -> list[str]:
        """Undo one ``pin`` of ``keys``; returns those of them no pin holds any more."""
        wanted = list(keys)
        with self._lock:
            self._pinned.subtract(wanted)
            free = [key for key in dict.fromkeys(wanted) if self._pinned[key] <= 0]
            for key in free:
                del self._pinned[key]
        return free

    def remove(self, keys: Sequence[str]) -> int:
        """Remove ``keys`` from every tier now (blocks only one reader could ever ask for: an
        offloaded shifted KV's); returns the bytes freed. Queued writes of them still land (the
        collector removes those later)."""
        self.forget(keys)
        return sum(self._remove_quietly(tier, list(keys)) for tier in self.tiers)

    def forget(self, keys: Iterable[str]) -> None:
        """Stop counting ``keys`` as stored (another process removed them)."""
        with self._lock:
            for key in keys:
                self._known.pop(key, None)

    # ---- lifecycle ------------------------------------------------------------------------
    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written (True) or ``timeout`` seconds pass (False)."""
        return True if self._behind is None else self._behind.flush(timeout)

    def usage(self) -> BlockStoreUsage:
        """The tiers' and the queue's counters now: ``store.usage().write_behind.pending_bytes``."""
        return BlockStoreUsage(tuple(t.usage() for t in self.tiers),
                               None if self._behind is None else self._behind.usage(), self._corrupt)

    def check(self) -> None:
        """Fail now, with ``BlockTierUnavailable`` saying what to fix, if a tier cannot be used."""
        for tier in self.tiers:
            tier.check()

    def close(self, timeout: float | None = 30.0) -> None:
        """Write what is queued (waiting at most ``timeout`` seconds), then stop the writers."""
        self.closed = True
        if self._behind is not None:
            self._behind.close(timeout)
        for tier in self.tiers:
            close = getattr(tier, "close", None)  # NOTE: the S3 tier's transfer threads; not in the protocol
            if callable(close):
                close()
