"""Tests of ``ThreadChannel``'s lead (``agentkv/engine/decode/thread_channel.py``), the queue the
threaded decode driver hands deltas over: an item posted with ``size=n`` counts as n against the lead,
and ``wait_for_room`` waits while the lead is unreceived, as ``post`` does first."""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread

from agentkv.engine.decode.thread_channel import ThreadChannel


async def test_an_item_posted_with_size_n_counts_as_n_against_the_lead() -> None:
    channel: ThreadChannel[str] = ThreadChannel(lead=4)
    second_posted = threading.Event()

    def produce() -> None:
        channel.post("batch of 4", size=4)
        channel.post("next")  # 4 unreceived: waits
        second_posted.set()

    thread = threading.Thread(target=produce)
    thread.start()
    await anyio.sleep(0.05)
    assert not second_posted.is_set()
    assert await channel.receive() == "batch of 4"
    assert await anyio.to_thread.run_sync(second_posted.wait, 5)
    assert await channel.receive() == "next"
    thread.join(5)
    small: ThreadChannel[str] = ThreadChannel(lead=4)
    small.post("batch of 3", size=3)
    small.post("fits", wait=True)  # 3 unreceived < 4: does not wait
    assert [await small.receive(), await small.receive()] == ["batch of 3", "fits"]


async def test_wait_for_room_waits_while_the_lead_is_unreceived() -> None:
    channel: ThreadChannel[str] = ThreadChannel(lead=2)
    room = threading.Event()
    channel.post("a", size=2)
    waiter = threading.Thread(target=lambda: (channel.wait_for_room(), room.set()))
    waiter.start()
    await anyio.sleep(0.05)
    assert not room.is_set()
    assert await channel.receive() == "a"
    assert await anyio.to_thread.run_sync(room.wait, 5)
    waiter.join()
