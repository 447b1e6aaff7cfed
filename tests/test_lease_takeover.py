"""A replica whose host dies: its leases are taken over from another host once they expire, within
a server request's lease wait, so the request is answered, not refused; a holder that only stalled
loses its run, never the history (every write it would still make is fenced).

Two "hosts" are two holder ids with different host parts (``holder_id("host-a")``): the takeover is
the cross-host one (by expiry), never the same-host shortcut for a dead pid. Lease expiry reads the
stores' ``FakeClock``; SQLite files and PostgreSQL.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from test_run_recovery import call
from _stores import new_conversation

from agentkv import Agent, Runtime, tool
from agentkv.chat.messages import Message
from agentkv.errors import LeaseLost, ConversationBusy, StoreUnavailable
from agentkv.memory import Store
from agentkv.memory.leases import (
    CROSS_HOST_TAKEOVER_S,
    DEFAULT_LEASE_WAIT_S,
    DEFAULT_LEASE_TTL_S,
    LEASE_POLL_MAX_S,
    LeaseKeeper,
    holder_id,
    holder_is_dead_here,
    parse_holder,
)
from agentkv.runtime.persistence import INTERRUPTED_RESULT
from agentkv.testing import FakeClock, ScriptedEngine

HOST_A, HOST_B = holder_id("host-a"), holder_id("host-b")


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def host_a(store_url: str, tmp_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    async with Store(store_url, snapshot_dir=tmp_path / "snapshots", clock=clock) as opened:
        yield opened


@pytest.fixture
async def host_b(store_url: str, tmp_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    async with Store(store_url, snapshot_dir=tmp_path / "snapshots", clock=clock) as opened:
        yield opened


def test_a_crashed_hosts_lease_is_taken_over_before_a_waiting_request_gives_up() -> None:
    assert CROSS_HOST_TAKEOVER_S == DEFAULT_LEASE_TTL_S + LEASE_POLL_MAX_S
    assert CROSS_HOST_TAKEOVER_S < DEFAULT_LEASE_WAIT_S  # `agentkv serve --lease-wait`'s default
    assert Runtime(ScriptedEngine([])).lease_ttl_s == DEFAULT_LEASE_TTL_S
    assert parse_holder(HOST_A)[0] == "host-a" and not holder_is_dead_here(HOST_A)  # only expiry frees it


async def test_another_hosts_lease_is_taken_over_once_its_default_ttl_has_passed(
        host_a: Store, host_b: Store, clock: FakeClock) -> None:
    sid = await new_conversation(host_a)
    old = await host_a.acquire_lease(sid, HOST_A, DEFAULT_LEASE_TTL_S)  # then host a dies: no renewal
    clock.advance(DEFAULT_LEASE_TTL_S - 0.5)
    with pytest.raises(ConversationBusy, match="host-a"):
        await host_b.acquire_lease(sid, HOST_B, DEFAULT_LEASE_TTL_S)
    clock.advance(0.6)
    new = await host_b.acquire_lease(sid, HOST_B, DEFAULT_LEASE_TTL_S)
    assert new > old and await host_b.lease_holder(sid) == HOST_B
    with pytest.raises(LeaseLost, match="host-b"):  # were host a only cut off, its writes are refused
        await host_a.append_message(sid, Message.user("late"), token_count=2, fence=old)


async def test_a_run_waiting_on_a_crashed_hosts_conversation_is_answered_once_the_lease_expires(
        host_a: Store, host_b: Store, clock: FakeClock, monkeypatch: pytest.MonkeyPatch) -> None:
    agent = Agent(name="helper", instructions="Be brief.")
    first = Runtime(ScriptedEngine(["Hello."]), host_a, holder=HOST_A)
    conversation = await first.open_conversation(agent)
    await first.run(conversation, "Hi")

    async def unreachable(*args: object, **kwargs: object) -> None:
        raise StoreUnavailable(host_a.url, OSError("host a is gone"))

    second = Runtime(ScriptedEngine(["Welcome back."]), host_b, agents=[agent], holder=HOST_B,
                     lease_wait_s=DEFAULT_LEASE_WAIT_S)
    resumed = await second.resume(conversation.id)
    entered = anyio.Event()

    async def crash_mid_run() -> None:  # host a takes the lease for a run, then dies with it
        monkeypatch.setattr(host_a, "release_lease", unreachable)
        monkeypatch.setattr(host_a, "renew_lease", unreachable)
        with anyio.CancelScope() as scope:
            async with LeaseKeeper(host_a, conversation.id, HOST_A, ttl_s=DEFAULT_LEASE_TTL_S):
                entered.set()
                scope.cancel()
                await anyio.sleep_forever()

    await crash_mid_run()
    assert await host_b.lease_holder(conversation.id) == HOST_A  # left behind by the crash

    async def time_passes() -> None:
        await anyio.sleep(0.2)  # the request is waiting by now
        clock.advance(DEFAULT_LEASE_WAIT_S - 1)  # most of its wait, not all of it

    started = time.monotonic()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(time_passes)
        result = await second.run(resumed, "Still there?")
    assert result.final_text == "Welcome back." and time.monotonic() - started < DEFAULT_LEASE_WAIT_S
    assert [m.message.content for m in await host_b.messages(conversation.id)] == [
        "Hi", "Hello.", "Still there?", "Welcome back."]


async def test_a_stalled_holder_that_lost_its_lease_to_another_host_writes_nothing_more(
        host_a: Store, host_b: Store, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    started, finish = anyio.Event(), anyio.Event()

    @tool
    async def slow(city: str) -> str:
        """Look a city up slowly (host a's run stalls in here)."""
        started.set()
        await finish.wait()
        return "late result"

    agent = Agent(name="slow-agent", instructions="Use slow.", tools=[slow])
    # NOTE: a long ttl keeps host a's real-time heartbeat out of the test; its lease still expires
    # on the shared fake clock, which is what a stall past the ttl looks like to host b.
    first = Runtime(ScriptedEngine([call("slow", city="Oslo"), "never"]), host_a, holder=HOST_A, lease_ttl_s=60)
    conversation = await first.open_conversation(agent)
    outcome: list[BaseException] = []

    async def run_a() -> None:
        try:
            await first.run(conversation, "Oslo?")
        except LeaseLost as error:
            outcome.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run_a)
        await started.wait()
        calls_before = len(await host_b.calls(conversation.id))
        clock.advance(61)
        second = Runtime(ScriptedEngine(["Oslo: 12 C."]), host_b, agents=[agent], holder=HOST_B)
        resumed = await second.resume(conversation.id)  # the cross-host takeover: host a's lease expired
        assert resumed.resume_report.interrupted_calls == 1
        with caplog.at_level(logging.WARNING):
            finish.set()
            await anyio.sleep(0)
            while conversation.running:
                await anyio.sleep(0.01)
    assert len(outcome) == 1 and "resume the conversation" in str(outcome[0])
    stored = [m.message for m in await host_b.messages(conversation.id)]
    assert [(m.role, m.content) for m in stored if m.role == "tool"] == [("tool", INTERRUPTED_RESULT)]
    assert len(await host_b.calls(conversation.id)) == calls_before  # nor its call figures
    assert await host_b.snapshots(conversation.id) == []  # nor a snapshot of its KV
    assert "could not save a KV snapshot" in caplog.text
    result = await second.run(resumed, "And now?")
    assert result.final_text == "Oslo: 12 C."


async def test_a_keeper_that_stalled_past_its_ttl_says_so_when_it_renews(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    sid = await new_conversation(store)
    with caplog.at_level(logging.WARNING, logger="agentkv.memory.leases"):
        async with LeaseKeeper(store, sid, HOST_A, ttl_s=0.3) as lease:
            time.sleep(0.4)  # a blocked event loop: no renewal can run
            await anyio.sleep(0.3)
            assert lease.held  # nobody wanted it meanwhile: renewed
    assert "past its ttl of 0.3 s: this process stalled" in caplog.text


async def test_a_server_request_for_a_conversation_whose_replicas_host_crashed_is_answered_not_refused(
        tmp_path: Path, clock: FakeClock) -> None:
    import httpx

    from agentkv.server import create_app

    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    store = Store(url, clock=clock)
    app = create_app(ScriptedEngine(["Hello!", "Still here."]), store=store, api_key="sk-test", model_id="scripted",
                     lease_wait_s=DEFAULT_LEASE_WAIT_S)  # the server's default wait
    body = {"model": "scripted", "temperature": 0}
    async with app.router.lifespan_context(app), httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test",
            headers={"Authorization": "Bearer sk-test"}, timeout=30) as client:
        first = await client.post("/v1/responses", json={**body, "input": "Hi"})
        session = first.headers["X-Session-Id"]
        await store.acquire_lease(session, HOST_A, DEFAULT_LEASE_TTL_S)  # replica a's next run, then its host dies

        async def time_passes() -> None:
            await anyio.sleep(0.2)  # the request is waiting by now
            clock.advance(DEFAULT_LEASE_WAIT_S - 1)  # most of its wait, not all of it

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(time_passes)
            answer = await client.post("/v1/responses", json={**body, "input": "Still there?",
                                                              "previous_response_id": first.json()["id"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["output"][0]["content"][0]["text"] == "Still here."
    await store.close()
