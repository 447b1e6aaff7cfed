"""Tests for session leases: dead-holder takeover, LeaseKeeper heartbeats, operator release.

Real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set), real child processes.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from _stores import REPO, new_conversation, race_for_lease

from agentkv.errors import LeaseLost, ConversationBusy, ConversationNotFound, UserError
from agentkv.memory.leases import (
    LeaseKeeper,
    holder_id,
    holder_is_dead_here,
    parse_holder,
)
from agentkv.memory import Store
from agentkv.testing import FakeClock

HOST = socket.gethostname()


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def sleeping_child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def clocked_store(store_url: str, tmp_path: Path, clock: FakeClock) -> AsyncIterator[Store]:
    """A store whose leases read ``clock``: a test advances it instead of sleeping out a TTL."""
    async with Store(store_url, snapshot_dir=tmp_path / "snapshots", clock=clock) as opened:
        yield opened


# -- holder ids ------------------------------------------------------------------------------

def test_holder_ids_parse_back_to_this_host_and_pid() -> None:
    assert parse_holder(holder_id()) == (HOST, os.getpid())
    assert holder_id() != holder_id()
    assert parse_holder("box1:4242:9f3a1c") == ("box1", 4242)
    for odd in ["worker-a", "box1:4242", "box1:x42:tag", "box1:0:tag", ":42:tag", "box1:42:",
                "box1:-3:tag", "box1:٤٢:tag"]:
        assert parse_holder(odd) is None, odd
    assert not holder_is_dead_here(holder_id())
    assert holder_is_dead_here(f"{HOST}:{dead_pid()}:abc123")
    assert not holder_is_dead_here(f"elsewhere.invalid:{dead_pid()}:abc123")
    assert not holder_is_dead_here("worker-a")


# -- takeover --------------------------------------------------------------------------------

async def test_a_dead_local_holder_is_taken_over_at_once(store: Store) -> None:
    sid = await new_conversation(store)
    dead = f"{HOST}:{dead_pid()}:dead01"
    await store.acquire_lease(sid, dead, ttl_s=600)
    await store.acquire_lease(sid, "worker-b", ttl_s=60)
    assert await store.lease_holder(sid) == "worker-b"


async def test_a_live_local_holder_keeps_its_lease_until_it_dies(store: Store) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, f"{HOST}:{os.getpid()}:other1", ttl_s=600)
    with pytest.raises(ConversationBusy, match="other1"):
        await store.acquire_lease(sid, f"{HOST}:{os.getpid()}:mine01")

    child = sleeping_child()
    try:
        await store.release_lease(sid, force=True)
        await store.acquire_lease(sid, f"{HOST}:{child.pid}:child1", ttl_s=600)
        with pytest.raises(ConversationBusy, match="child1"):
            await store.acquire_lease(sid, "worker-b")
    finally:
        child.kill()
        child.wait()
    await store.acquire_lease(sid, "worker-b")
    assert await store.lease_holder(sid) == "worker-b"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="zombies are read from /proc")
async def test_a_killed_but_unreaped_local_holder_counts_as_dead(store: Store) -> None:
    sid = await new_conversation(store)
    child = sleeping_child()
    try:
        await store.acquire_lease(sid, f"{HOST}:{child.pid}:zombie", ttl_s=600)
        os.kill(child.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while "Z" not in Path(f"/proc/{child.pid}/stat").read_text(encoding="utf-8").rpartition(")")[2][:3]:
            assert time.monotonic() < deadline, "the child did not become a zombie"
            await anyio.sleep(0.01)
        await store.acquire_lease(sid, "worker-b")
    finally:
        child.kill()
        child.wait()


async def test_a_holder_on_another_host_is_taken_over_only_after_expiry(
        clocked_store: Store, clock: FakeClock) -> None:
    store = clocked_store
    sid = await new_conversation(store)
    await store.acquire_lease(sid, f"elsewhere.invalid:{dead_pid()}:far001", ttl_s=0.3)
    with pytest.raises(ConversationBusy, match="elsewhere.invalid"):
        await store.acquire_lease(sid, "worker-b")
    clock.advance(0.4)
    assert await store.lease_holder(sid) is None  # expired: nobody holds it now
    await store.acquire_lease(sid, "worker-b")
    assert await store.lease_holder(sid) == "worker-b"


async def test_processes_racing_to_take_over_a_dead_holder_exactly_one_wins(
        store: Store, store_url: str, tmp_path: Path) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, f"{HOST}:{dead_pid()}:dead01", ttl_s=600)
    outputs = await race_for_lease(store_url, tmp_path, sid, [f"{HOST}:{os.getpid()}:proc{i}" for i in range(3)])
    assert sorted(out.strip() for out, _ in outputs) == ["busy", "busy", "won"], outputs
    assert ":proc" in (await store.lease_holder(sid) or "")


# -- operator release ------------------------------------------------------------------------

async def test_force_release_frees_the_lease_and_names_the_previous_holder(store: Store) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, "worker-a", ttl_s=600)
    assert await store.lease_holder(sid) == "worker-a"
    assert await store.release_lease(sid, force=True) == "worker-a"
    assert await store.lease_holder(sid) is None
    assert await store.release_lease(sid, force=True) is None
    await store.acquire_lease(sid, "worker-b")
    assert await store.release_lease(sid, "worker-b") is None  # positional holder still works
    assert await store.lease_holder(sid) is None


async def test_force_release_of_an_unknown_session_is_not_found(store: Store) -> None:
    with pytest.raises(ConversationNotFound):
        await store.release_lease("absent", force=True)
    with pytest.raises(ConversationNotFound):
        await store.lease_holder("absent")
    with pytest.raises(UserError, match="force=True"):
        await store.release_lease("absent")
    with pytest.raises(UserError, match="force=True"):
        await store.release_lease("absent", "worker-a", force=True)


# -- LeaseKeeper -----------------------------------------------------------------------------

async def test_lease_keeper_renews_while_the_block_runs(store: Store) -> None:
    sid = await new_conversation(store)
    async with LeaseKeeper(store, sid, "keeper", ttl_s=0.6) as lease:
        for _ in range(3):
            await anyio.sleep(0.5)
            with pytest.raises(ConversationBusy, match="keeper"):
                await store.acquire_lease(sid, "intruder")
        assert lease.held and not lease.lost
        assert await store.lease_holder(sid) == "keeper"
    assert not lease.held
    assert await store.lease_holder(sid) is None


async def test_lease_keeper_releases_on_cancellation_and_on_errors(store: Store) -> None:
    sid = await new_conversation(store)
    with anyio.move_on_after(0.2) as scope:
        async with LeaseKeeper(store, sid, "keeper", ttl_s=0.3):
            await anyio.sleep(10)
    assert scope.cancelled_caught
    assert await store.lease_holder(sid) is None

    with pytest.raises(ValueError, match="boom"):  # the block's own exception, not a group
        async with LeaseKeeper(store, sid, "keeper", ttl_s=0.3) as lease:
            raise ValueError("boom")
    assert await store.lease_holder(sid) is None

    async with LeaseKeeper(store, sid, "keeper", ttl_s=0.3) as lease:
        await lease.release()
        await lease.release()  # releasing twice is harmless
        await anyio.sleep(0.2)  # and no renewal takes it back
        assert await store.lease_holder(sid) is None
    with pytest.raises(UserError, match="single use"):
        async with lease:
            pass


async def test_lease_keeper_that_loses_its_lease_says_so_without_crashing(
        store: Store, caplog: pytest.LogCaptureFixture) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, "other", ttl_s=600)
    with pytest.raises(ConversationBusy, match="other"):
        async with LeaseKeeper(store, sid, "keeper", ttl_s=0.3):
            pytest.fail("entered the block without the lease")

    await store.release_lease(sid, force=True)
    with caplog.at_level(logging.WARNING, logger="agentkv.memory.leases"):
        async with LeaseKeeper(store, sid, "keeper", ttl_s=0.3) as lease:
            await store.release_lease(sid, force=True)
            await store.acquire_lease(sid, "other", ttl_s=600)
            await anyio.sleep(0.3)
            assert lease.lost and not lease.held
    assert "lost the lease" in caplog.text
    assert await store.lease_holder(sid) == "other"  # leaving did not release someone else's


HOLDING_WORKER = """
import sys, anyio
from agentkv.memory.leases import LeaseKeeper, holder_id
from agentkv.memory import Store

url, snapshot_dir, conversation_id = sys.argv[1:4]

async def main():
    store = Store(url, snapshot_dir=snapshot_dir)
    async with LeaseKeeper(store, conversation_id, holder_id(), ttl_s=600):
        print("held", flush=True)
        await anyio.sleep(600)

anyio.run(main)
"""


async def test_a_sigkilled_keeper_does_not_block_the_next_process(store: Store, store_url: str,
                                                                  tmp_path: Path) -> None:
    sid = await new_conversation(store)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    worker = subprocess.Popen([sys.executable, "-c", HOLDING_WORKER, store_url,
                               str(tmp_path / "snapshots"), sid],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert worker.stdout is not None
        line = await anyio.to_thread.run_sync(worker.stdout.readline)
        assert line == "held\n", worker.stderr.read() if worker.stderr else ""
        with pytest.raises(ConversationBusy, match=f":{worker.pid}:"):
            await store.acquire_lease(sid, holder_id())
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.communicate()
    mine = holder_id()
    started = time.monotonic()
    async with LeaseKeeper(store, sid, mine, ttl_s=600):
        assert await store.lease_holder(sid) == mine
    assert time.monotonic() - started < 2


# -- fencing: a holder that lost its lease cannot write ------------------------------------------

async def test_a_write_fenced_by_a_lost_lease_is_refused_and_leaves_nothing(store: Store) -> None:
    from agentkv.chat.messages import Message

    sid = await new_conversation(store)
    old = await store.acquire_lease(sid, "old-holder", ttl_s=600)
    await store.append_message(sid, Message.user("hi"), token_count=2, fence=old)
    assert await store.release_lease(sid, force=True) == "old-holder"  # an operator's unlock
    with pytest.raises(LeaseLost, match="resume the conversation"):
        await store.renew_lease(sid, "old-holder", old, ttl_s=600)  # released: not renewed back
    new = await store.acquire_lease(sid, "new-holder", ttl_s=600)
    assert new != old
    await store.append_message(sid, Message.user("from the new holder"), token_count=2, fence=new)
    with pytest.raises(LeaseLost, match="new-holder"):
        await store.append_message(sid, Message.user("late"), token_count=2, fence=old)
    with pytest.raises(LeaseLost):
        await store.replace_in_window(sid, [1], Message.user("late summary"), token_count=2, fence=old)
    assert [m.message.content for m in await store.messages(sid)] == ["hi", "from the new holder"]
    assert await store.renew_lease(sid, "new-holder", new, ttl_s=600) is None  # the holder's own renewal
    assert await store.acquire_lease(sid, "new-holder", ttl_s=600) == new  # re-taking its own keeps the token


async def test_a_run_whose_lease_was_taken_mid_tool_never_records_a_second_result(store_url: str) -> None:
    """Two holders: A's tool is still running when an operator force-unlocks and B resumes
    (recording the call's "interrupted" result); A's late result is refused."""
    from test_run_recovery import call

    from agentkv import Agent, Runtime, tool
    from agentkv.runtime.persistence import INTERRUPTED_RESULT
    from agentkv.testing import ScriptedEngine

    started, finish = anyio.Event(), anyio.Event()

    @tool
    async def slow(city: str) -> str:
        """Look a city up slowly."""
        started.set()
        await finish.wait()
        return "late result"

    agent = Agent(name="slow-agent", instructions="Use slow.", tools=[slow])
    first = Runtime(ScriptedEngine([call("slow", city="Oslo"), "never"]), Store(store_url), holder="holder-a")
    session = await first.open_conversation(agent)
    outcome: list[BaseException] = []

    async def run_a() -> None:
        try:
            await first.run(session, "Oslo?")
        except LeaseLost as error:
            outcome.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run_a)
        await started.wait()
        store = Store(store_url)
        assert await store.release_lease(session.id, force=True) == "holder-a"
        second = Runtime(ScriptedEngine([]), store, agents=[agent], holder="holder-b")
        resumed = await second.resume(session.id)
        assert resumed.resume_report.interrupted_calls == 1
        finish.set()
    assert len(outcome) == 1 and "resume the conversation" in str(outcome[0])
    results = [m.message for m in await store.messages(session.id) if m.message.role == "tool"]
    assert [r.content for r in results] == [INTERRUPTED_RESULT]  # one call id, one result
    await store.close()
    await first.store.close()


def test_cli_unlock_refuses_a_holder_still_running_here_unless_forced(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from agentkv.cli.app import app

    url = f"sqlite:///{tmp_path / 'a.db'}"
    live = f"{HOST}:{os.getpid()}:cafe01"  # this very process: alive on this host
    gone = f"{HOST}:{dead_pid()}:cafe02"

    async def lease_to(holder: str) -> str:
        async with Store(url) as store:
            stored = await store.list_conversations()
            sid = stored[0].id if stored else await new_conversation(store)
            await store.release_lease(sid, force=True)
            await store.acquire_lease(sid, holder, ttl_s=600)
            return sid

    async def holder_of(sid: str) -> str | None:
        async with Store(url) as store:
            return await store.lease_holder(sid)

    sid = anyio.run(lease_to, live)
    refused = CliRunner().invoke(app, ["conversations", "unlock", sid, "--db", url])
    assert refused.exit_code == 1 and f"process {os.getpid()} still running on this host" in refused.output
    assert "--force" in refused.output and anyio.run(holder_of, sid) == live  # untouched
    forced = CliRunner().invoke(app, ["conversations", "unlock", sid, "--force", "--db", url])
    assert forced.exit_code == 0 and "next write to the conversation will be refused" in forced.output
    assert anyio.run(holder_of, sid) is None
    anyio.run(lease_to, gone)
    released = CliRunner().invoke(app, ["conversations", "unlock", sid, "--db", url])  # a dead holder needs no --force
    assert released.exit_code == 0 and gone in released.output and anyio.run(holder_of, sid) is None


# -- waiting for a lease another replica holds ------------------------------------------------

async def test_a_lease_keeper_that_may_wait_gets_the_lease_once_the_holder_releases_it(store: Store) -> None:
    sid = await new_conversation(store)
    took = await store.acquire_lease(sid, "other-replica", 30)

    async def release_soon() -> None:
        await anyio.sleep(0.3)
        await store.release_lease(sid, "other-replica")

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(release_soon)
        started = time.monotonic()
        async with LeaseKeeper(store, sid, "keeper", ttl_s=5, wait_s=10) as lease:
            waited = time.monotonic() - started
            assert lease.held and await store.lease_holder(sid) == "keeper"
            assert lease.token is not None and lease.token > took  # a new fencing token: the old holder's writes fail
    assert 0.3 <= waited < 5  # it waited for the release, not for the whole wait


async def test_a_lease_keeper_gives_up_with_session_busy_after_its_wait(store: Store) -> None:
    sid = await new_conversation(store)
    await store.acquire_lease(sid, "other-replica", 30)
    started = time.monotonic()
    with pytest.raises(ConversationBusy, match="other-replica"):
        async with LeaseKeeper(store, sid, "keeper", ttl_s=5, wait_s=0.4):
            pytest.fail("the lease was held by another replica all along")
    assert time.monotonic() - started >= 0.4
    assert await store.lease_holder(sid) == "other-replica"  # untouched
    with pytest.raises(UserError, match="wait_s"):
        LeaseKeeper(store, sid, "keeper", wait_s=-1)
