"""Store's session leases on real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is
set): a second holder waits, an expired lease is taken over, and of processes racing for one lease
exactly one wins."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from _stores import new_conversation, race_for_lease

from agentkv.errors import ConversationBusy, ConversationNotFound
from agentkv.memory import Store


async def test_second_holder_is_busy_until_the_lease_is_released(store: Store) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, "worker-a", ttl_s=30)
    with pytest.raises(ConversationBusy, match="worker-a") as busy:
        await store.acquire_lease(sid, "worker-b")
    assert busy.value.holder == "worker-a"

    first_expiry = (await store.get_conversation(sid)).lease_expires_at
    await store.acquire_lease(sid, "worker-a", ttl_s=300)  # the holder renews
    renewed = await store.get_conversation(sid)
    assert renewed.lease_holder == "worker-a" and renewed.lease_expires_at > first_expiry

    await store.release_lease(sid, "worker-b")  # not the holder: nothing happens
    assert (await store.get_conversation(sid)).lease_holder == "worker-a"
    await store.release_lease(sid, "worker-a")
    await store.release_lease(sid, "worker-a")  # releasing twice is harmless
    await store.acquire_lease(sid, "worker-b")
    assert (await store.get_conversation(sid)).lease_holder == "worker-b"


async def test_an_expired_lease_is_taken_over(store: Store) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, "crashed-worker", ttl_s=0.05)
    await anyio.sleep(0.1)
    await store.acquire_lease(sid, "worker-b")
    assert (await store.get_conversation(sid)).lease_holder == "worker-b"


async def test_a_lease_on_a_missing_session_is_not_found(store: Store) -> None:
    with pytest.raises(ConversationNotFound):
        await store.acquire_lease("absent", "worker-a")


async def test_processes_racing_for_one_lease_exactly_one_wins(store: Store, store_url: str,
                                                               tmp_path: Path) -> None:
    sid = await new_conversation(store)
    outputs = await race_for_lease(store_url, tmp_path, sid, [f"proc-{i}" for i in range(3)])
    results = sorted(out.strip() for out, _ in outputs)
    assert results == ["busy", "busy", "won"], [err for _, err in outputs]
    holder = (await store.get_conversation(sid)).lease_holder
    assert holder is not None and holder.startswith("proc-")
