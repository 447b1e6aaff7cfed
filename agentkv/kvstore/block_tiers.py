"""The KV store's tiers: the protocol every tier (host memory, local disk, an object store) follows,
the types they share, and the host tier, a byte-bounded LRU in process memory.

A tier knows keys (``kv/block_keys.py``: 32 lowercase hex digits, a block's content address) and
bytes, never sessions or messages::

    host = HostBlocks(max_bytes=2 << 30)
    host.put(chain.keys[0], data)
    found = host.get_many(chain.keys)       # {key: bytes} for the blocks it holds
    host.usage().hits                       # counters for /metrics and `conversations show --kv`

The disk tier is ``block_files.DiskBlocks``, the object store ``block_objects.ObjectBlocks``; the
persistent ones are written off the turn by ``write_behind.WriteBehind``.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Protocol

from cachetools import Cache, LRUCache

from agentkv.errors import AgentKVError, UserError

__all__ = ["BlockTier", "BlockTierUnavailable", "HostBlocks", "StoredBlock", "TierCounters", "TierUsage",
           "WarningLimiter", "check_data", "check_key",
           "is_key"]

_KEY = re.compile(r"[0-9a-f]{32}")


class BlockTierUnavailable(AgentKVError):
    """A tier cannot be written or used now (disk full or read-only, bucket unreachable, credentials
    refused); the message names the tier and what to fix. The store then keeps fewer blocks and
    re-prefills the rest: never a failed turn."""


@dataclass(frozen=True)
class StoredBlock:
    """One entry of a tier's listing (for garbage collection): ``for block in disk.listing(): ...``."""

    key: str
    """The block's key (32 hex digits)."""
    nbytes: int
    """Bytes the tier holds for it (disk: the file's size, header included)."""
    modified: datetime
    """UTC: when written (disk: the file's mtime, touched on read; S3: LastModified; host: insertion time)."""


@dataclass(frozen=True)
class TierUsage:
    """A tier's counters, for /metrics and ``conversations show --kv``: ``disk.usage().nbytes``."""

    tier: str
    """"host", "disk" or "s3"."""
    blocks: int
    """Blocks held now (S3: -1, unknown without a listing)."""
    nbytes: int
    """Bytes held now (S3: -1, unknown without a listing)."""
    max_bytes: int | None
    """The bound (None: unbounded)."""
    hits: int
    """Keys asked for and returned."""
    misses: int
    """Keys asked for and not returned (absent, or unreadable)."""
    bytes_read: int
    """Bytes returned by ``get_many``."""
    bytes_written: int
    """Bytes stored by ``put`` (a block already held is not written again)."""
    evicted_blocks: int
    """Blocks removed to stay under ``max_bytes``."""


class BlockTier(Protocol):
    """Where blocks are kept, by key. Every method is thread-safe; keys are validated (``UserError``
    for anything but 32 lowercase hex digits)::

        found = tier.get_many(keys)          # reads; refreshes recency; never raises for a bad block
        tier.put(key, data)                  # stores (idempotent); may evict; BlockTierUnavailable
    """

    name: str
    """"host", "disk" or "s3"."""
    persistent: bool
    """Outlives the process (disk, s3): the write-behind queue writes these."""

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The blocks this tier holds among ``keys`` (absent ones left out); parallel where the tier
        allows. Refreshes their recency. A block that cannot be read is logged once and counted as a
        miss, never raised."""
        ...

    def has_many(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` this tier holds (does not change recency or counters)."""
        ...

    def put(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``; idempotent (same key, same content by construction). A
        bounded tier evicts its least recently used blocks to stay under its bound; a block larger
        than the bound is not kept. ``BlockTierUnavailable`` when the tier cannot be written."""
        ...

    def remove(self, keys: Iterable[str]) -> int:
        """Delete these blocks (missing ones are fine); returns the bytes freed."""
        ...

    def listing(self) -> Iterator[StoredBlock]:
        """Every block the tier holds (for garbage collection)."""
        ...

    def usage(self) -> TierUsage:
        """The tier's counters now."""
        ...

    def check(self) -> None:
        """``BlockTierUnavailable`` now, saying what to fix, if the tier cannot be used."""
        ...


def check_key(key: str) -> str:
    """``key`` if it is a block key (32 lowercase hex digits), else ``UserError``: keys become file
    names and object keys, so nothing else may reach a tier. ``check_key(chain.keys[0])``."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        raise UserError(f"a block key is 32 lowercase hex digits (KVNamespace.chain(...).keys), got {key!r}")
    return key


def is_key(text: str) -> bool:
    """True if ``text`` is a block key (32 lowercase hex digits): ``is_key(name[:-4])``."""
    return _KEY.fullmatch(text) is not None


def check_data(key: str, data: bytes) -> bytes:
    """``data`` as bytes if it is a bytes-like block, else ``UserError``: ``check_data(key, payload)``."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise UserError(f"block {key} must be bytes (the encoded block), got {type(data).__name__}")
    return bytes(data)


class TierCounters:
    """Thread-safe hit/miss/byte counters a tier keeps: ``counters.read(hits=3, misses=1, nbytes=n)``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.hits = self.misses = self.bytes_read = self.bytes_written = self.evicted_blocks = 0

    def read(self, *, hits: int, misses: int, nbytes: int) -> None:
        """Count one ``get_many``: keys returned, keys not returned, bytes returned."""
        with self._lock:
            self.hits += hits
            self.misses += misses
            self.bytes_read += nbytes

    def wrote(self, nbytes: int) -> None:
        """Count one block stored."""
        with self._lock:
            self.bytes_written += nbytes

    def evicted(self, blocks: int = 1) -> None:
        """Count blocks removed to stay under the bound."""
        with self._lock:
            self.evicted_blocks += blocks

    def usage(self, tier: str, *, blocks: int, nbytes: int, max_bytes: int | None) -> TierUsage:
        """A ``TierUsage`` of these counters and what the tier holds now."""
        with self._lock:
            return TierUsage(tier=tier, blocks=blocks, nbytes=nbytes, max_bytes=max_bytes, hits=self.hits,
                             misses=self.misses, bytes_read=self.bytes_read, bytes_written=self.bytes_written,
                             evicted_blocks=self.evicted_blocks)


class WarningLimiter:
    """At most one log line per topic per ``interval`` seconds, saying how many were held back:
    ``limiter.warn(log, "s3", "bucket unreachable: %s", reason)`` (a tier that is down logs a line a
    minute, not one per block)."""

    def __init__(self, interval: float = 60.0) -> None:
        self.interval = interval
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}

    def warn(self, log: logging.Logger, topic: str, message: str, *args: object) -> bool:
        """Log ``message % args`` as a warning unless ``topic`` logged within the interval; True if logged."""
        now = time.monotonic()
        with self._lock:
            last = self._last.get(topic)
            if last is not None and now - last < self.interval:
                self._held[topic] = self._held.get(topic, 0) + 1
                return False
            self._last[topic] = now
            held = self._held.pop(topic, 0)
        suffix = f" ({held} more like it in the last {self.interval:g} s not logged)" if held else ""
        log.warning(message + suffix, *args)
        return True


@dataclass(frozen=True)
class _Held:
    """A block in host memory and when it was put there."""

    data: bytes
    written: datetime


def _held_size(held: _Held) -> int:
    return len(held.data)


class _CountingLRU(LRUCache[str, _Held]):
    """cachetools' byte-bounded LRU that counts what it evicts."""

    def __init__(self, max_bytes: int, counters: TierCounters) -> None:
        super().__init__(maxsize=max_bytes, getsizeof=_held_size)
        self._counters = counters

    def popitem(self) -> tuple[str, _Held]:
        item = super().popitem()
        self._counters.evicted()
        return item


class HostBlocks:
    """L2: blocks in this process's memory, at most ``max_bytes`` of them, least recently used
    evicted first (cachetools' ``LRUCache`` sized by bytes); gone when the process ends::

        host = HostBlocks(max_bytes=1 << 30)
        host.put(key, data); host.get_many([key])   # {key: data}
    """

    name = "host"
    persistent = False

    def __init__(self, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise UserError(f"max_bytes must be a positive int (the host tier's bound in bytes, e.g. 1 << 30), "
                            f"got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._counters = TierCounters()
        self._cache = _CountingLRU(max_bytes, self._counters)
        self._lock = threading.Lock()

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The blocks held among ``keys``; each one read becomes recently used, the first of ``keys``
        (a chain's, in log order: the ones other chains share) the most recently."""
        wanted = [check_key(key) for key in keys]
        found: dict[str, bytes] = {}
        with self._lock:
            for key in reversed(wanted):
                held = self._cache.get(key)  # LRUCache.get refreshes recency
                if held is not None:
                    found[key] = held.data
        self._counters.read(hits=len(found), misses=len(wanted) - len(found),
                            nbytes=sum(len(data) for data in found.values()))
        return found

    def has_many(self, keys: Sequence[str]) -> set[str]:
        """The keys held among ``keys`` (recency unchanged)."""
        wanted = [check_key(key) for key in keys]
        with self._lock:
            return {key for key in wanted if key in self._cache}

    def put(self, key: str, data: bytes) -> None:
        """Keep ``data`` under ``key``, evicting the least recently used blocks to stay under
        ``max_bytes``; a block larger than the bound is not kept. A key already held is refreshed."""
        data = check_data(check_key(key), data)
        if len(data) > self.max_bytes:
            return
        with self._lock:
            if key in self._cache:
                self._cache[key]  # a read refreshes recency; the content is the same by key
                return
            self._cache[key] = _Held(data, datetime.now(timezone.utc))
        self._counters.wrote(len(data))

    def remove(self, keys: Iterable[str]) -> int:
        """Drop these blocks (missing ones are fine); the bytes freed."""
        wanted = [check_key(key) for key in keys]
        freed = 0
        with self._lock:
            for key in wanted:
                held = self._cache.pop(key, None)
                if held is not None:
                    freed += len(held.data)
        return freed

    def listing(self) -> Iterator[StoredBlock]:
        """Every block held (a copy: the tier may change meanwhile); recency unchanged."""
        with self._lock:  # NOTE: Cache.__getitem__, not LRUCache's: a listing is no read
            held = [(key, Cache.__getitem__(self._cache, key)) for key in list(self._cache.keys())]
        return iter([StoredBlock(key, len(block.data), block.written) for key, block in held])

    def usage(self) -> TierUsage:
        """Blocks and bytes held, the bound, and the counters."""
        with self._lock:
            blocks, nbytes = len(self._cache), int(self._cache.currsize)
        return self._counters.usage(self.name, blocks=blocks, nbytes=nbytes, max_bytes=self.max_bytes)

    def check(self) -> None:
        """Process memory is always usable: nothing to check."""
