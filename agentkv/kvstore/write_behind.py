"""Write-behind: blocks reach the persistent tiers (disk, object store) off the turn's critical path,
through a bounded queue with back-pressure.

``submit`` only queues a block; worker threads write the queue in order to every tier. A failed
write is logged (one line per tier per minute), counted and not retried: a tier that is down must
not grow memory, and a block that never arrived is prefilled again by the next turn that needs it.
**A crash (the process killed) loses at most what is queued or being written**: the SQL history
stays the source of truth, and the next turn re-prefills only the missing blocks::

    with WriteBehind([disk, objects], max_pending_bytes=256 << 20) as behind:
        behind.submit(key, data)       # returns at once (waits only while the queue is full)
        behind.flush(timeout=5.0)      # True once every queued block is written (or failed)
        behind.usage().written_blocks
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import TracebackType

from agentkv.errors import UserError
from agentkv.kvstore.block_tiers import BlockTier, WarningLimiter, check_data, check_key

__all__ = ["WriteBehind", "WriteBehindUsage"]

log = logging.getLogger(__name__)

DEFAULT_SUBMIT_TIMEOUT_S = 10.0
"""How long ``submit`` waits for room in a full queue before it drops the block."""


@dataclass(frozen=True)
class WriteBehindUsage:
    """The queue now and what it has done: ``behind.usage().pending_bytes``."""

    pending_blocks: int
    """Blocks queued or being written."""
    pending_bytes: int
    """Their bytes (what the queue holds in memory; bounded by ``max_pending_bytes``)."""
    max_pending_bytes: int
    """The bound ``submit`` waits on."""
    written_blocks: int
    """Blocks every tier now holds (written, or already there: another replica wrote it)."""
    written_bytes: int
    """Bytes written to tiers (a block written to two tiers counts twice; one already held, not at all)."""
    dropped_blocks: int
    """Blocks never written: the queue stayed full past ``submit``'s timeout, or it was closed."""
    failed_blocks: int
    """Blocks at least one tier failed to write (the other tiers still got them)."""


class WriteBehind:
    """Writes submitted blocks to ``tiers`` on ``workers`` threads, holding at most about
    ``max_pending_bytes`` queued; see the module docstring for a call. Thread-safe; a context
    manager (``close`` on exit)."""

    def __init__(self, tiers: Sequence[BlockTier], *, max_pending_bytes: int, workers: int = 2,
                 on_failure: Callable[[str], None] | None = None) -> None:
        """``on_failure(key)`` is called (on a worker thread) for each block a tier failed to write
        or that was dropped, so its owner stops counting it as stored."""
        if not isinstance(max_pending_bytes, int) or isinstance(max_pending_bytes, bool) or max_pending_bytes <= 0:
            raise UserError(f"max_pending_bytes must be a positive int (the write-behind queue's bound in bytes, "
                            f"e.g. 256 << 20), got {max_pending_bytes!r}")
        if not isinstance(workers, int) or isinstance(workers, bool) or workers <= 0:
            raise UserError(f"workers must be a positive int (threads writing the queue, e.g. 2), got {workers!r}")
        self.tiers = tuple(tiers)
        self.max_pending_bytes = max_pending_bytes
        self._on_failure = on_failure
        self._cond = threading.Condition()
        self._queued: OrderedDict[str, bytes] = OrderedDict()  # oldest first
        self._in_flight: dict[str, int] = {}  # key -> bytes
        self._pending_bytes = 0
        self._closed = False
        self._written_blocks = self._written_bytes = self._dropped = self._failed = 0
        self._limiter = WarningLimiter(60.0)
        self._threads = [threading.Thread(target=self._work, name=f"agentkv-write-behind-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, key: str, data: bytes, *, timeout: float | None = DEFAULT_SUBMIT_TIMEOUT_S) -> bool:
        """Queue ``data`` for every tier; True once queued (or already queued or being written:
        a key is never queued twice). While the queue holds ``max_pending_bytes`` or more, waits
        up to ``timeout`` seconds (None: until there is room); then, or after ``close``, drops the
        block with a warning and returns False (never raises for that: the turn goes on). A block
        larger than the bound waits for an empty queue."""
        data = check_data(check_key(key), data)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                if key in self._queued or key in self._in_flight:
                    return True
                if self._closed:
                    return self._drop(key, "the write-behind queue is closed")
                if self._pending_bytes == 0 or self._pending_bytes + len(data) <= self.max_pending_bytes:
                    break
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return self._drop(key, f"the queue stayed full ({self._pending_bytes} of "
                                           f"{self.max_pending_bytes} bytes) for {timeout:g} s: the tiers write "
                                           "slower than turns produce KV; raise max_pending_bytes or use faster tiers")
                self._cond.wait(left)
            self._queued[key] = data
            self._pending_bytes += len(data)
            self._cond.notify_all()
        return True

    def pending(self) -> tuple[int, int]:
        """(blocks, bytes) queued or being written."""
        with self._cond:
            return len(self._queued) + len(self._in_flight), self._pending_bytes

    def usage(self) -> WriteBehindUsage:
        """The queue now and the counters."""
        with self._cond:
            return WriteBehindUsage(
                pending_blocks=len(self._queued) + len(self._in_flight), pending_bytes=self._pending_bytes,
                max_pending_bytes=self.max_pending_bytes, written_blocks=self._written_blocks,
                written_bytes=self._written_bytes, dropped_blocks=self._dropped, failed_blocks=self._failed)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or being written: True, or False after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queued or self._in_flight:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not any(thread.is_alive() for thread in self._threads):
                    return False  # stopped: nothing will drain the queue
                self._cond.wait(left)
            return True

    def wait_for(self, keys: Iterable[str], timeout: float | None = None) -> bool:
        """Wait until none of ``keys`` is queued or being written (written, failed or dropped):
        True, or False after ``timeout`` seconds. What a save waits on before its row names them."""
        wanted = set(keys)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while wanted & (self._queued.keys() | set(self._in_flight)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                if not any(thread.is_alive() for thread in self._threads):
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float | None = None) -> bool:
        """Flush (up to ``timeout`` seconds), then stop the workers; blocks still queued then are
        dropped and counted. Idempotent. True if everything submitted was written (or failed)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        flushed = self.flush(timeout)
        with self._cond:
            self._closed = True
            if self._queued:
                log.warning("write-behind closed with %d blocks (%d bytes) not written; the next turns that need "
                            "them will prefill them", len(self._queued), sum(map(len, self._queued.values())))
                self._dropped += len(self._queued)
                self._pending_bytes -= sum(map(len, self._queued.values()))
                self._queued.clear()
            self._cond.notify_all()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return flushed

    def __enter__(self) -> WriteBehind:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _drop(self, key: str, why: str) -> bool:
        """Count a block not queued and say why (rate-limited); the caller holds the condition."""
        self._dropped += 1
        self._limiter.warn(log, "dropped", "KV block %s not written to the persistent tiers: %s", key, why)
        return False

    def _work(self) -> None:
        """A worker: take the oldest queued block, write it to every tier, repeat until closed."""
        while True:
            with self._cond:
                while not self._queued and not self._closed:
                    self._cond.wait()
                if not self._queued:
                    return
                key, data = self._queued.popitem(last=False)
                self._in_flight[key] = len(data)
            written, failed = self._write(key, data)
            if failed and self._on_failure is not None:  # NOTE: before the key leaves: waiters see it done
                try:
                    self._on_failure(key)
                except Exception:  # never kill the worker
                    log.exception("the write-behind failure callback raised for KV block %s", key)
            with self._cond:
                del self._in_flight[key]
                self._pending_bytes -= len(data)
                self._written_bytes += written
                if failed:
                    self._failed += 1
                else:
                    self._written_blocks += 1
                self._cond.notify_all()

    def _write(self, key: str, data: bytes) -> tuple[int, bool]:
        """Write one block to every tier that lacks it: (bytes written, whether a tier failed)."""
        written, failed = 0, False
        for tier in self.tiers:
            try:
                if key in tier.has_many([key]):
                    continue  # another replica (or an earlier process) wrote it
                tier.put(key, data)
                written += len(data)
            except Exception as e:  # any tier failure: count it, never kill the worker
                failed = True
                self._limiter.warn(log, f"tier:{tier.name}", "writing KV blocks to the %s tier failed: %s; "
                                   "those blocks are dropped and will be prefilled again", tier.name, e)
        return written, failed
