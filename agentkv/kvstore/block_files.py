"""L3 of the KV store: blocks as files on local disk, bounded by bytes, least recently used evicted.

One file per block, ``<root>/<key[:2]>/<key>.kvb``: a 32-byte header (magic, payload length, the
key's 16 bytes) then the block's bytes. A file is written to a temp file in its own directory and
renamed over its name (``os.replace``), so a reader sees a whole block or none; there is no fsync
per block: a crash (or power loss) may lose or truncate a block written just before, which a read
then finds short and treats as a miss, and the store re-prefills it. Recency is the file's mtime,
touched on every read, so two processes sharing the directory (e.g. two servers on one machine) see
each other's reads and writes::

    disk = DiskBlocks(Path("~/.cache/agentkv/kv").expanduser(), max_bytes=20 << 30)
    disk.put(key, data)
    disk.get_many([key, other])     # {key: data}: other is absent (a miss)

The bound is kept through an in-memory index (recency order, sizes) built by one scan on first use,
so a put or an eviction never rescans. A process's index knows the blocks it found at that scan
plus those it wrote or read since: blocks another process wrote meanwhile count toward this
process's bound once it reads them (each process keeps its own bound over what it knows).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator, Sequence
from datetime import datetime, timezone
from pathlib import Path

from cachetools import LRUCache

from agentkv.errors import UserError
from agentkv.kvstore.block_tiers import (
    BlockTierUnavailable,
    StoredBlock,
    TierCounters,
    TierUsage,
    check_data,
    check_key,
    is_key,
)

__all__ = ["BLOCK_SUFFIX", "DiskBlocks"]

log = logging.getLogger(__name__)

BLOCK_SUFFIX = ".kvb"
"""The end of every block file's name."""
_MAGIC = b"agentkvB"  # 8 bytes, then the payload length (u64 little-endian), then the key's 16 bytes
_HEADER = 32
_TEMP_SUFFIX = ".tmp"
_STALE_TEMP_S = 3600.0  # a temp file this old is left by a crash: the first scan removes it
_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskBlocks:
    """Blocks under ``root`` (created on first write), at most ``max_bytes`` of files (None:
    unbounded). See the module docstring for a call."""

    name = "disk"
    persistent = True

    def __init__(self, root: Path, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or isinstance(max_bytes, bool)
                                      or max_bytes <= 0):
            raise UserError(f"max_bytes must be a positive int (the disk tier's bound in bytes, e.g. 20 << 30) "
                            f"or None (unbounded), got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self._counters = TierCounters()
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, float]] | None = None  # key -> (file bytes, mtime), LRU first
        self._nbytes = 0
        self._warned: LRUCache[str, bool] = LRUCache(maxsize=4096)  # keys whose bad file was logged

    def path(self, key: str) -> Path:
        """The file of ``key``: ``root/ab/ab…(32 hex).kvb``."""
        key = check_key(key)
        return self.root / key[:2] / f"{key}{BLOCK_SUFFIX}"

    # -- BlockTier --------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The blocks on disk among ``keys``; each one read has its mtime touched (recency). A
        missing, truncated or foreign file is a miss (a bad one is logged once and removed, so the
        re-prefilled block is written again)."""
        paths = [(key, self.path(key)) for key in keys]
        found: dict[str, bytes] = {}
        for key, path in paths:
            data = self._read(key, path)
            if data is None:
                continue
            found[key] = data
            now = time.time()
            try:
                os.utime(path, (now, now))
            except OSError:
                pass  # removed meanwhile (another process evicted it) or read-only: the read still counts
            self._remember(key, len(data) + _HEADER, now)
        self._counters.read(hits=len(found), misses=len(paths) - len(found),
                            nbytes=sum(len(data) for data in found.values()))
        return found

    def has_many(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` that have a file (recency unchanged)."""
        return {key for key, path in [(key, self.path(key)) for key in keys] if path.is_file()}

    def put(self, key: str, data: bytes) -> None:
        """Write the block (temp file + rename) unless its file exists (then only its recency is
        refreshed), then evict the least recently used files over ``max_bytes``. A block larger than
        the bound is not kept. ``BlockTierUnavailable`` for a full or unwritable disk (no temp
        file is left behind)."""
        path = self.path(key)
        data = check_data(key, data)
        size = len(data) + _HEADER
        if self.max_bytes is not None and size > self.max_bytes:
            return
        self._ensure_index()
        now = time.time()
        try:
            os.utime(path, (now, now))
            self._remember(key, size, now)
            return
        except FileNotFoundError:
            pass
        except OSError as e:
            raise self._unavailable("refresh", e) from e
        self._write(key, path, data)
        self._counters.wrote(size)
        self._remember(key, size, time.time())
        self._evict()

    def remove(self, keys: Iterable[str]) -> int:
        """Delete these blocks' files (missing ones are fine); the bytes freed."""
        freed = 0
        for key in keys:
            path = self.path(key)
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                size = 0
            except OSError as e:
                raise self._unavailable("remove", e) from e
            freed += size
            self._forget(key)
        return freed

    def listing(self) -> Iterator[StoredBlock]:
        """Every block file under ``root`` now (a fresh scan: other processes' blocks included)."""
        for key, size, mtime in self._scan():
            yield StoredBlock(key, size, datetime.fromtimestamp(mtime, timezone.utc))

    def usage(self) -> TierUsage:
        """Blocks and bytes this process knows on disk (see the module docstring), the bound, counters."""
        self._ensure_index()
        with self._lock:
            blocks, nbytes = len(self._index or ()), self._nbytes
        return self._counters.usage(self.name, blocks=blocks, nbytes=nbytes, max_bytes=self.max_bytes)

    def check(self) -> None:
        """``BlockTierUnavailable`` unless ``root`` can be created and written (a probe file is
        written and removed)."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=self.root, prefix=".probe-", suffix=_TEMP_SUFFIX)
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            raise self._unavailable("check", e) from e

    # -- internals --------------------------------------------------------------------------------

    def _read(self, key: str, path: Path) -> bytes | None:
        """The block's bytes, or None for a missing or bad file (logged once, removed)."""
        try:
            with path.open("rb") as f:
                raw = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            self._warn_once(key, f"KV block file {path} cannot be read ({e}); its tokens will be prefilled again")
            return None
        expected = len(raw) - _HEADER
        if (len(raw) < _HEADER or raw[:8] != _MAGIC or int.from_bytes(raw[8:16], "little") != expected
                or raw[16:_HEADER] != bytes.fromhex(key)):
            self._warn_once(key, f"KV block file {path} is truncated or not this block's ({len(raw)} bytes); "
                                 "removed, its tokens will be prefilled and written again")
            self._discard(key, path)
            return None
        return raw[_HEADER:]

    def _write(self, key: str, path: Path, data: bytes) -> None:
        """Header + data into a temp file beside ``path``, renamed over it; the temp file never stays."""
        temp: str | None = None
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{key}.", suffix=_TEMP_SUFFIX)
            with open(fd, "wb") as f:
                f.write(_MAGIC + len(data).to_bytes(8, "little") + bytes.fromhex(key))
                f.write(data)
            os.replace(temp, path)
            temp = None
        except OSError as e:
            raise self._unavailable("write", e) from e
        finally:
            if temp is not None:
                try:
                    os.unlink(temp)
                except OSError:
                    pass

    def _scan(self) -> Iterator[tuple[str, int, float]]:
        """(key, bytes, mtime) of every block file; removes temp files a crash left (over an hour old)."""
        try:
            shards = sorted((entry for entry in os.scandir(self.root) if entry.is_dir() and len(entry.name) == 2),
                            key=lambda entry: entry.name)
        except FileNotFoundError:
            return
        except OSError as e:
            raise self._unavailable("list", e) from e
        for shard in shards:
            try:
                entries = list(os.scandir(shard.path))
            except FileNotFoundError:
                continue
            for entry in entries:
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue  # removed meanwhile
                key = entry.name[:-len(BLOCK_SUFFIX)]
                if entry.name.endswith(BLOCK_SUFFIX) and is_key(key) and key.startswith(shard.name):
                    yield key, stat.st_size, stat.st_mtime
                elif entry.name.endswith(_TEMP_SUFFIX) and time.time() - stat.st_mtime > _STALE_TEMP_S:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass

    def _ensure_index(self) -> None:
        """Build the recency index from one scan of ``root`` (first use only)."""
        with self._lock:
            if self._index is not None:
                return
        found = sorted(self._scan(), key=lambda entry: entry[2])
        with self._lock:
            if self._index is None:
                self._index = OrderedDict((key, (size, mtime)) for key, size, mtime in found)
                self._nbytes = sum(size for _, size, _ in found)

    def _remember(self, key: str, size: int, mtime: float) -> None:
        """Mark ``key`` (of ``size`` file bytes) most recently used, if the index is built."""
        with self._lock:
            if self._index is None:
                return
            old = self._index.pop(key, None)
            self._nbytes += size - (old[0] if old else 0)
            self._index[key] = (size, mtime)

    def _forget(self, key: str) -> None:
        with self._lock:
            old = self._index.pop(key, None) if self._index is not None else None
            self._nbytes -= old[0] if old else 0

    def _discard(self, key: str, path: Path) -> None:
        try:
            path.unlink()
        except OSError:
            pass
        self._forget(key)

    def _evict(self) -> None:
        """Remove the least recently used files until the index fits ``max_bytes``. A file whose
        mtime moved on since it was indexed (another process read it) is moved to the end instead."""
        if self.max_bytes is None:
            return
        with self._lock:
            index = self._index
            if index is None:
                return
            for _ in range(len(index)):
                if self._nbytes <= self.max_bytes or len(index) <= 1:
                    break
                key, (size, mtime) = next(iter(index.items()))
                path = self.root / key[:2] / f"{key}{BLOCK_SUFFIX}"
                try:
                    current = path.stat().st_mtime
                except FileNotFoundError:
                    current = None
                if current is not None and current > mtime + 1e-3:
                    index.move_to_end(key)
                    index[key] = (size, current)
                    continue
                del index[key]
                self._nbytes -= size
                try:
                    path.unlink()
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("could not evict KV block file %s (%s); the disk tier may exceed its bound", path, e)
                    continue
                self._counters.evicted()

    def _warn_once(self, key: str, message: str) -> None:
        with self._lock:
            if key in self._warned:
                return
            self._warned[key] = True
        log.warning(message)

    def _unavailable(self, what: str, error: OSError) -> BlockTierUnavailable:
        if error.errno in _FULL:
            hint = f"free space on the disk of {self.root} or lower the disk tier's bound (max_bytes)"
        elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = f"make {self.root} writable by this user, or point the disk tier at another directory"
        else:
            hint = f"check the disk and the directory {self.root}"
        return BlockTierUnavailable(f"the KV disk tier at {self.root} failed ({what}): {error}; {hint}")
