"""ThreadChannel: items a worker thread hands to the event loop, in order, with a bounded lead.

``post(item)`` from the thread does not wait for the event loop to take the item (on asyncio:
``call_soon_threadsafe`` wakes the loop, the thread goes on), except while ``lead`` items are
still unreceived: a paused or abandoned consumer stops its producer there (an item that stands
for several, ``post(batch, size=len(batch))``, counts as that many). ``await receive()``
on the loop takes them in order and is a cancellation point even when items are queued::

    channel = ThreadChannel[int](lead=8)          # created on the event loop
    channel.post(5)                               # from the worker thread
    item = await channel.receive()                # on the event loop
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")


class ThreadChannel(Generic[T]):
    """See the module docstring. Create it on the event loop that receives."""

    def __init__(self, lead: int) -> None:
        if lead < 1:
            raise ValueError(f"lead must be at least 1, got {lead}")
        self._items: deque[tuple[T, int]] = deque()
        self._unreceived = 0
        self._changed = threading.Condition()
        self._waiter: anyio.Event | None = None
        self._lead = lead
        self._wake, self.posts_without_waiting = _waker()
        """``post(..., wait=False)`` returns without waiting for the event loop (asyncio); on other
        anyio backends it waits for the loop to take the wake-up."""

    def wait_for_room(self) -> None:
        """Wait while ``lead`` items are unreceived (what ``post`` does first): a thread that must
        not wait later, where it posts, waits here before."""
        with self._changed:
            while self._unreceived >= self._lead:
                self._changed.wait()

    def post(self, item: T, *, wait: bool = True, size: int = 1) -> None:
        """Queue ``item``, counted as ``size`` items (from any thread); with ``wait``, first wait
        while ``lead`` items are unreceived."""
        with self._changed:
            while wait and self._unreceived >= self._lead:
                self._changed.wait()
            self._items.append((item, size))
            self._unreceived += size
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            self._wake(waiter.set)

    async def receive(self) -> T:
        """The next item, waiting for one; raises the caller's cancellation first, if any."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            with self._changed:
                if self._items:
                    item, size = self._items.popleft()
                    self._unreceived -= size
                    self._changed.notify()
                    return item
                self._waiter = waiter = anyio.Event()
            await waiter.wait()


def _waker() -> tuple[Callable[[Callable[[], object]], None], bool]:
    """``wake(fn)`` from any thread: ``fn()`` runs on this event loop soon, the caller not waiting
    (asyncio), or waiting for the loop to run it (other anyio backends); and whether it does not wait."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        token = anyio.lowlevel.current_token()

        def wake_waiting(fn: Callable[[], object]) -> None:
            anyio.from_thread.run_sync(fn, token=token)

        return wake_waiting, False

    def wake(fn: Callable[[], object]) -> None:
        try:
            loop.call_soon_threadsafe(fn)
        except RuntimeError:
            pass  # the event loop has closed: nobody receives any more

    return wake, True
