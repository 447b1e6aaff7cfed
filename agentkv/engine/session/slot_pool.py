"""The slot pool: binds sessions to KV slots, leases a slot for one operation, offloads LRU idle sessions.

A session keeps its slot between calls (its KV stays in the model). When every slot is
bound and another session needs one, the least-recently-used *idle* session is offloaded
(its KV copied to a host snapshot by its ``offload`` callback) and its slot reused; that
session is restored when it runs again. A leased slot is never evicted nor used by two
calls at once::

    async with pool.lease(session) as slot:
        logits = await anyio.to_thread.run_sync(slot.feed, ids, 0)

Offloaded KV is held by a ``HostKVStore`` under a host byte budget; beyond it the least
recently offloaded snapshots are spilled to files (``spill_dir``) or dropped, and a session
whose KV was dropped re-prefills its tokens when it next runs.
"""

from __future__ import annotations

import os
import threading
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import anyio

from agentkv.kv.log import KVSlot, KVSource
from agentkv.kv.snapshot import SUFFIX, KVSnapshot
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError


class SlotOwner(Protocol):
    """What the pool needs from a session."""

    def offload(self, slot: KVSlot) -> None:
        """Copy the KV out of ``slot`` to host memory (blocking; runs in a worker thread)."""

    def adopt(self, slot: KVSlot) -> None:
        """Called (blocking, in a worker thread) when ``slot`` is newly bound: restore KV into it."""


class SlotPool:
    """Fixed set of slots shared by any number of sessions."""

    def __init__(self, slots: list[KVSlot], host: HostKVStore | None = None,
                 lease_ended: Callable[[KVSlot], None] | None = None) -> None:
        """``lease_ended(slot)`` runs on the event loop each time a lease on ``slot`` ends."""
        self.host = host or HostKVStore()
        """Where offloaded sessions' KV waits (byte budget, spill or drop)."""
        self._lease_ended = lease_ended
        self._free: list[KVSlot] = list(slots)
        self._bound: OrderedDict[SlotOwner, KVSlot] = OrderedDict()  # LRU first
        self._leased: set[SlotOwner] = set()
        self._changed = anyio.Condition()
        self.size = len(slots)
        self.offloads = 0
        self.limiter = anyio.CapacityLimiter(max(1, len(slots)))

    @asynccontextmanager
    async def lease(
        self, owner: SlotOwner, prepare: Callable[[KVSlot], Awaitable[None]] | None = None
    ) -> AsyncIterator[KVSlot]:
        """Hold ``owner``'s slot (binding one, evicting an idle session if needed) for the block.
        ``prepare`` runs on a newly bound slot before ``owner.adopt`` fills it (the paged
        backend makes room there for the KV the owner brings)."""
        slot, fresh = await self._acquire(owner)
        try:
            if fresh:
                try:
                    if prepare is not None:
                        await prepare(slot)
                    await anyio.to_thread.run_sync(owner.adopt, slot, limiter=self.limiter)
                except BaseException:
                    with anyio.CancelScope(shield=True):
                        await self.release(owner)  # unbind: the next lease starts from a fresh slot
                    raise
            yield slot
        finally:
            with anyio.CancelScope(shield=True):
                async with self._changed:
                    self._leased.discard(owner)
                    still_bound = self._bound.get(owner) is slot  # not after a failed bind: another's now
                    self._changed.notify_all()
            if self._lease_ended is not None and still_bound:
                self._lease_ended(slot)

    async def _acquire(self, owner: SlotOwner) -> tuple[KVSlot, bool]:
        async with self._changed:
            while True:
                if owner in self._bound:
                    self._bound.move_to_end(owner)
                    self._leased.add(owner)
                    return self._bound[owner], False
                if self._free:
                    slot = self._free.pop()
                    break
                evicted = await self._offload_lru(self.limiter)
                if evicted is not None:
                    slot = evicted
                    break
                await self._changed.wait()
            self._bound[owner] = slot
            self._leased.add(owner)
            return slot, True

    async def offload_idle(self) -> bool:
        """Offload the least recently used idle session (its KV to the host store, its slot
        emptied and freed); False when every bound session is in use. For backends whose slots
        share storage (paged blocks): frees what that session held."""
        async with self._changed:
            # NOTE: the default thread limiter: the caller may hold one of ours while it waits
            slot = await self._offload_lru(None)
            if slot is None:
                return False
            self._free.append(slot)
            self._changed.notify_all()
            return True

    async def _offload_lru(self, limiter: anyio.CapacityLimiter | None) -> KVSlot | None:
        """Offload the least recently used idle session and unbind it; its emptied slot, or None
        if every bound session is in use. The caller holds ``_changed``."""
        victim = next((o for o in self._bound if o not in self._leased), None)
        if victim is None:
            return None
        slot = self._bound.pop(victim)
        self._leased.add(victim)  # NOTE: keeps the victim from re-binding mid-offload
        try:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(victim.offload, slot, limiter=limiter)
        except BaseException:
            self._bound[victim] = slot
            self._bound.move_to_end(victim, last=False)
            raise
        finally:
            self._leased.discard(victim)
        self.offloads += 1
        return slot

    async def release(self, owner: SlotOwner) -> None:
        """Unbind ``owner``'s slot (its KV is discarded) and return it to the free list."""
        async with self._changed:
            slot = self._bound.pop(owner, None)
            if slot is not None:
                await anyio.to_thread.run_sync(slot.reset, limiter=self.limiter)
                self._free.append(slot)
            self._leased.discard(owner)
            self._changed.notify_all()

    def is_bound(self, owner: SlotOwner) -> bool:
        """True if ``owner`` holds a slot now."""
        return owner in self._bound

    @property
    def bound(self) -> int:
        """How many slots sessions hold now: ``pool.bound``."""
        return len(self._bound)

    def leased_slots(self) -> list[KVSlot]:
        """The slots of sessions running a call now (holding a lease): ``len(pool.leased_slots())``;
        the other bound ones are idle (offloaded when a slot or room is needed)."""
        return [slot for owner, slot in self._bound.items() if owner in self._leased]


@dataclass(frozen=True)
class HostKVStats:
    """Counters of a ``HostKVStore`` since it was made, and its size now."""

    bytes: int
    """Bytes of offloaded KV held in memory now (never above the budget)."""
    budget_bytes: int | None
    in_memory: int
    """Snapshots held in memory now."""
    on_disk: int
    """Snapshots spilled to files now."""
    spills: int
    drops: int
    disk_loads: int
    """Spilled snapshots read back."""
    reprefilled_tokens: int
    """Tokens re-prefilled because their offloaded KV had been dropped (or its file was unreadable)."""


class OffloadedKV(Protocol):
    """KV a session holds while it has no slot: a ``HostKVReceipt`` receipt (a host copy) or the paged
    engine's ``SharedBlocks`` (references on blocks). ``take()`` hands it over for loading
    (None: it was dropped — re-prefill), ``load()`` reads it as a snapshot, ``release()`` lets go."""

    @property
    def num_tokens(self) -> int: ...

    def take(self) -> KVSource | None: ...
    def load(self) -> KVSnapshot | None: ...
    def release(self) -> None: ...


class HostKVReceipt:
    """Receipt for one offloaded snapshot in a ``HostKVStore``: in memory, in a spill file, or dropped.

    ``load()`` reads it (None once dropped), ``take()`` reads then releases, ``release()``
    forgets it and deletes any spill file. Releasing twice is harmless.
    """

    def __init__(self, store: HostKVStore, snapshot: KVSnapshot) -> None:
        self.num_tokens = snapshot.num_tokens
        self.num_bytes = snapshot.nbytes
        self.fingerprint = snapshot.fingerprint
        self._store = store
        self._snapshot: KVSnapshot | None = snapshot
        self._path: Path | None = None
        self._released = False

    @property
    def where(self) -> Literal["memory", "disk", "dropped"]:
        """Where the KV is now."""
        return "memory" if self._snapshot is not None else "disk" if self._path is not None else "dropped"

    def load(self) -> KVSnapshot | None:
        """The snapshot (reading a spilled file; blocking), or None if it was dropped."""
        return self._store._load(self)

    def take(self) -> KVSnapshot | None:
        """``load()`` then ``release()``; a None for a non-empty snapshot counts as a re-prefill."""
        snapshot = self.load()
        self.release()
        if snapshot is None and self.num_tokens:
            self._store._count("reprefilled_tokens", self.num_tokens)
        return snapshot

    def release(self) -> None:
        self._store._release(self)


class HostKVStore:
    """Offloaded KV under a host byte budget; beyond it, least recently offloaded first is
    spilled to ``spill_dir`` (or dropped when there is none)::

        store = HostKVStore(budget_bytes=1 << 30, spill_dir="/var/tmp/agentkv")
        receipt = store.put(snapshot)      # may spill or drop older entries (blocking)
        snapshot = receipt.take()          # None if it was dropped: re-prefill instead
    """

    def __init__(self, budget_bytes: int | None = None, spill_dir: str | os.PathLike[str] | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise UserError(f"offload budget must be >= 0 bytes or None (unbounded), got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self.spill_dir = None if spill_dir is None else Path(spill_dir)
        if self.spill_dir is not None:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._held: OrderedDict[HostKVReceipt, None] = OrderedDict()  # in memory, least recent first
        self._bytes = 0
        self._on_disk = 0
        self._counts = dict.fromkeys(("spills", "drops", "disk_loads", "reprefilled_tokens"), 0)

    def put(self, snapshot: KVSnapshot) -> HostKVReceipt:
        """Hold ``snapshot``; spills or drops the least recent entries (maybe this one) to fit."""
        entry = HostKVReceipt(self, snapshot)
        with self._lock:
            self._held[entry] = None
            self._bytes += entry.num_bytes
            self._fit()
        return entry

    def _fit(self) -> None:
        # NOTE: spill files are written under the lock: every caller runs in a worker thread.
        while self.budget_bytes is not None and self._bytes > self.budget_bytes and self._held:
            entry, _ = self._held.popitem(last=False)
            snapshot, entry._snapshot = entry._snapshot, None
            assert snapshot is not None
            self._bytes -= entry.num_bytes
            entry._path = self._spill(snapshot)
            self._counts["spills" if entry._path else "drops"] += 1
            self._on_disk += entry._path is not None

    def _spill(self, snapshot: KVSnapshot) -> Path | None:
        """Write ``snapshot`` to a new file in ``spill_dir``; None (drop) without one or on failure."""
        if self.spill_dir is None:
            return None
        path = self.spill_dir / f"{uuid.uuid4().hex}{SUFFIX}"
        try:
            snapshot.to_file(path)
        except OSError:
            return None
        return path

    def _load(self, entry: HostKVReceipt) -> KVSnapshot | None:
        with self._lock:
            if entry._snapshot is not None:
                if entry in self._held:
                    self._held.move_to_end(entry)
                return entry._snapshot
            path = entry._path
        if path is None:
            return None
        try:
            snapshot = KVSnapshot.from_file(path, expected_fingerprint=entry.fingerprint)
        except (SnapshotCorrupt, SnapshotIncompatible):
            return None  # our own spill file went bad: the caller re-prefills, never wrong KV
        self._count("disk_loads", 1)
        return snapshot

    def _release(self, entry: HostKVReceipt) -> None:
        with self._lock:
            if entry._released:
                return
            entry._released = True
            if entry in self._held:  # in memory ⟺ held, until released
                del self._held[entry]
                self._bytes -= entry.num_bytes
            entry._snapshot = None
            path, entry._path = entry._path, None
            self._on_disk -= path is not None
        if path is not None:
            path.unlink(missing_ok=True)

    def _count(self, name: str, n: int) -> None:
        with self._lock:
            self._counts[name] += n

    def stats(self) -> HostKVStats:
        """A consistent copy of the counters."""
        with self._lock:
            return HostKVStats(bytes=self._bytes, budget_bytes=self.budget_bytes, in_memory=len(self._held),
                               on_disk=self._on_disk, **self._counts)
