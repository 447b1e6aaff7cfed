"""The slot pool: binds sessions to KV slots, leases a slot for one operation, offloads LRU idle sessions.

A session keeps its slot between calls (its KV stays in the model). When every slot is
bound and another session needs one, the least-recently-used *idle* session is offloaded
(its KV copied to a host snapshot by its ``offload`` callback) and its slot reused; that
session is restored when it runs again. A leased slot is never evicted nor used by two
calls at once::

    async with pool.lease(session) as slot:
        logits = await anyio.to_thread.run_sync(slot.feed, ids, 0)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Protocol

import anyio

from agentkv.engine.slot import Slot


class SlotOwner(Protocol):
    """What the pool needs from a session."""

    def offload(self, slot: Slot) -> None:
        """Copy the KV out of ``slot`` to host memory (blocking; runs in a worker thread)."""

    def adopt(self, slot: Slot) -> None:
        """Called (blocking, in a worker thread) when ``slot`` is newly bound: restore KV into it."""


class SlotPool:
    """Fixed set of slots shared by any number of sessions."""

    def __init__(self, slots: list[Slot]) -> None:
        self._free: list[Slot] = list(slots)
        self._bound: OrderedDict[SlotOwner, Slot] = OrderedDict()  # LRU first
        self._leased: set[SlotOwner] = set()
        self._changed = anyio.Condition()
        self.size = len(slots)
        self.offloads = 0
        self.limiter = anyio.CapacityLimiter(max(1, len(slots)))

    @asynccontextmanager
    async def lease(self, owner: SlotOwner) -> AsyncIterator[Slot]:
        """Hold ``owner``'s slot (binding one, evicting an idle session if needed) for the block."""
        slot, fresh = await self._acquire(owner)
        try:
            if fresh:
                await anyio.to_thread.run_sync(owner.adopt, slot, limiter=self.limiter)
            yield slot
        finally:
            with anyio.CancelScope(shield=True):
                async with self._changed:
                    self._leased.discard(owner)
                    self._changed.notify_all()

    async def _acquire(self, owner: SlotOwner) -> tuple[Slot, bool]:
        async with self._changed:
            while True:
                if owner in self._bound:
                    self._bound.move_to_end(owner)
                    self._leased.add(owner)
                    return self._bound[owner], False
                if self._free:
                    slot = self._free.pop()
                    break
                victim = next((o for o in self._bound if o not in self._leased), None)
                if victim is not None:
                    slot = self._bound.pop(victim)
                    self._leased.add(victim)  # NOTE: keeps the victim from re-binding mid-offload
                    try:
                        with anyio.CancelScope(shield=True):
                            await anyio.to_thread.run_sync(victim.offload, slot, limiter=self.limiter)
                    except BaseException:
                        self._bound[victim] = slot
                        self._bound.move_to_end(victim, last=False)
                        raise
                    finally:
                        self._leased.discard(victim)
                    self.offloads += 1
                    break
                await self._changed.wait()
            self._bound[owner] = slot
            self._leased.add(owner)
            return slot, True

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
