"""The slot pool: binds sessions to KV slots, leases a slot for one operation, offloads LRU idle sessions.

A session keeps its slot between calls (its KV stays in the model). When every slot is
bound and another session needs one, the least-recently-used *idle* session is offloaded
(its KV copied to a host snapshot by its ``offload`` callback) and its slot reused; that
session is restored when it runs again. A leased slot is never evicted nor used by two
calls at once::

    async with pool.lease(session) as slot:
        logits = await anyio.to_thread.run_sync(slot.feed, ids, 0)

Offloaded KV is kept as keyed blocks by an ``OffloadStore`` (``offload_store.py``: the KV
store's tiers, host memory under a byte budget, optionally disk behind it); a session whose
blocks left the tiers re-prefills what is missing when it next runs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Protocol

import anyio

from agentkv.engine.session.offload_store import OffloadStore
from agentkv.kv.log import KVSlot, KVSource
from agentkv.kv.snapshot import KVSnapshot


class SlotOwner(Protocol):
    """What the pool needs from a session."""

    def offload(self, slot: KVSlot) -> None:
        """Copy the KV out of ``slot`` to host memory (blocking; runs in a worker thread)."""

    def adopt(self, slot: KVSlot) -> None:
        """Called (blocking, in a worker thread) when ``slot`` is newly bound: restore KV into it."""


class SlotPool:
    """Fixed set of slots shared by any number of sessions."""

    def __init__(self, slots: list[KVSlot], host: OffloadStore | None = None,
                 lease_ended: Callable[[KVSlot], None] | None = None) -> None:
        """``lease_ended(slot)`` runs on the event loop each time a lease on ``slot`` ends."""
        self.host = host or OffloadStore()
        """Where offloaded sessions' KV waits (keyed blocks in tiers: host bytes, maybe disk)."""
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


class OffloadedKV(Protocol):
    """KV a session holds while it has no slot: an ``OffloadReceipt`` (blocks in the KV store's
    tiers) or the paged engine's ``SharedBlocks`` (references on pool blocks). ``take()`` hands it
    over for loading (a prefix of it when blocks were lost; None: none left — re-prefill),
    ``load()`` reads it whole as a snapshot (None when it is not whole), ``release()`` lets go."""

    @property
    def num_tokens(self) -> int: ...

    def take(self) -> KVSource | None: ...
    def load(self) -> KVSnapshot | None: ...
    def release(self) -> None: ...
