"""Changes of a conversation's history made outside its run — rewind, fork (and so edit), delete,
prune — take the run's lease or are fenced by it, so none lands in the middle of a live run.

Each test races the change against a live run (scripted engine, a tool held open) through a
second ``Store``, as another process or the CLI would; SQLite files and PostgreSQL.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import anyio
import pytest
from test_run_recovery import call
from typer.testing import CliRunner

from agentkv import Agent, Runtime, tool
from agentkv.errors import LeaseLost, ConversationBusy, ConversationNotFound, UserError
from agentkv.memory import CallRecord, Store
from agentkv.run.conversation import Conversation
from agentkv.testing import ScriptedEngine

RUN_ROLES = ["user", "assistant", "tool", "assistant"]
"""The history one live run leaves: the question, its tool call, the result, the answer."""


@dataclass
class LiveRun:
    """A run of ``runtime`` on ``conversation`` held open inside its tool until ``finish`` is set."""

    runtime: Runtime
    conversation: Conversation
    started: anyio.Event
    finish: anyio.Event
    failures: list[BaseException]


def make_live_run(store: Store) -> tuple[Agent, anyio.Event, anyio.Event]:
    started, finish = anyio.Event(), anyio.Event()

    @tool
    async def slow(city: str) -> str:
        """Look a city up slowly."""
        started.set()
        await finish.wait()
        return "12 C"

    return Agent(name="slow-agent", instructions="Use slow.", tools=[slow]), started, finish


@asynccontextmanager
async def live_run(store_url: str, tmp_path: Path) -> AsyncIterator[LiveRun]:
    """A run in progress (its tool call stored, its result and answer not yet) in a task group;
    its tool returns on leaving, if the test did not let it before."""
    store = Store(store_url, snapshot_dir=tmp_path / "snapshots")
    agent, started, finish = make_live_run(store)
    runtime = Runtime(ScriptedEngine([call("slow", city="Oslo"), "Oslo: 12 C."]), store, holder="host-a:1:run001")
    conversation = await runtime.open_conversation(agent)
    failures: list[BaseException] = []

    async def run() -> None:
        try:
            await runtime.run(conversation, "Weather in Oslo?")
        except Exception as error:
            failures.append(error)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        await started.wait()
        try:
            yield LiveRun(runtime, conversation, started, finish, failures)
        finally:
            finish.set()
    await store.close()


@pytest.fixture
async def other(store_url: str, tmp_path: Path) -> AsyncIterator[Store]:
    """The same database as another process sees it (the CLI, an operator's script)."""
    async with Store(store_url, snapshot_dir=tmp_path / "snapshots", lease_wait_s=0) as opened:
        yield opened


async def roles(store: Store, conversation_id: str, *, in_window_only: bool = False) -> list[str]:
    return [m.message.role for m in await store.messages(conversation_id, in_window_only=in_window_only)]


async def finish_soon(run: LiveRun, delay_s: float = 0.3) -> None:
    await anyio.sleep(delay_s)
    run.finish.set()


async def test_a_rewind_during_a_live_run_waits_for_the_run_and_then_rewinds_its_whole_turn(
        store_url: str, tmp_path: Path, other: Store) -> None:
    other.lease_wait_s = 10
    async with live_run(store_url, tmp_path) as live, anyio.create_task_group() as tasks:
        sid = live.conversation.id
        tasks.start_soon(finish_soon, live)
        left = await other.rewind(sid, 0)  # while the tool runs: waits for the run's lease
    assert live.failures == []
    assert left == 4 and await roles(other, sid) == RUN_ROLES
    assert await roles(other, sid, in_window_only=True) == []  # no tool result left without its call


async def run_ends(run: LiveRun) -> None:
    run.finish.set()
    while run.conversation.running:
        await anyio.sleep(0.01)


async def test_a_rewind_that_cannot_wait_is_refused_saying_a_run_is_live_and_changes_nothing(
        store_url: str, tmp_path: Path, other: Store) -> None:
    async with live_run(store_url, tmp_path) as live:
        sid = live.conversation.id
        with pytest.raises(ConversationBusy,
                           match="cannot rewind .* a run is live in it .*host-a:1:run001.*retry") as busy:
            await other.rewind(sid, 0)
        assert busy.value.action == "rewind" and busy.value.holder == "host-a:1:run001"
        assert await roles(other, sid, in_window_only=True) == ["user", "assistant"]
        await run_ends(live)
    assert await roles(other, sid, in_window_only=True) == RUN_ROLES and live.failures == []
    assert await other.rewind(sid, 2) == 2  # free now
    assert await other.lease_holder(sid) is None  # the rewind's own lease went back


async def test_a_fork_during_a_live_run_never_takes_half_a_turn(store_url: str, tmp_path: Path, other: Store) -> None:
    async with live_run(store_url, tmp_path) as live, anyio.create_task_group() as tasks:
        sid = live.conversation.id
        with pytest.raises(ConversationBusy, match="cannot fork"):
            await other.fork_conversation(sid)
        assert [s.id for s in await other.list_conversations()] == [sid]  # no fork was made
        other.lease_wait_s = 10
        tasks.start_soon(finish_soon, live)
        fork = await other.fork_conversation(sid)  # waits for the run's end
    assert fork.fork_seq == 4 and await roles(other, fork.id) == RUN_ROLES


async def test_the_runtime_running_a_conversation_forks_it_at_a_stored_turn_under_its_own_lease(
        store_url: str, tmp_path: Path) -> None:
    async with live_run(store_url, tmp_path) as live:
        runtime, sid = live.runtime, live.conversation.id
        with anyio.fail_after(1):  # at once: never a wait on its own run's lease
            with pytest.raises(UserError, match="is running here: .* pass at=N"):
                await runtime.fork(live.conversation)
            branch = await runtime.fork(live.conversation, at=1)  # the question, stored before the model call
        assert branch.id != sid and [m.role for m in branch.messages] == ["user"]
        await run_ends(live)
    assert live.failures == []


async def test_an_edit_from_another_runtime_during_a_live_run_is_refused_and_makes_no_branch(
        store_url: str, tmp_path: Path) -> None:
    store = Store(store_url, snapshot_dir=tmp_path / "snapshots", lease_wait_s=0)
    async with live_run(store_url, tmp_path) as live:
        editor = Runtime(ScriptedEngine(["unused"]), store, agents=[live.conversation.agent], holder="host-b:2:edit01")
        resumed = await editor.resume(live.conversation.id)
        with pytest.raises(ConversationBusy, match="cannot fork"):
            await editor.edit(resumed, 1, "Weather in Bergen?")
        assert len(await store.list_conversations()) == 1
    await store.close()


async def test_a_delete_during_a_live_run_is_refused_and_the_run_finishes(
        store_url: str, tmp_path: Path, other: Store) -> None:
    async with live_run(store_url, tmp_path) as live:
        sid = live.conversation.id
        with pytest.raises(ConversationBusy, match="cannot delete"):
            await other.delete_conversation(sid)
        await run_ends(live)
    assert live.failures == [] and await roles(other, sid) == RUN_ROLES
    await other.delete_conversation(sid)  # free now
    with pytest.raises(ConversationNotFound):
        await other.get_conversation(sid)
    with pytest.raises(ConversationNotFound):
        await other.delete_conversation(sid)  # still the error it always was


async def test_prune_keeps_a_conversation_whose_run_is_live(store_url: str, tmp_path: Path, other: Store) -> None:
    async with live_run(store_url, tmp_path) as live:
        sid = live.conversation.id
        assert (await other.prune(older_than=timedelta(0))).conversations == ()
        await run_ends(live)
    assert await roles(other, sid) == RUN_ROLES and live.failures == []
    assert (await other.prune(older_than=timedelta(0))).conversations == (sid,)


async def test_a_holder_passes_its_own_token_and_a_lost_token_changes_nothing(store: Store) -> None:
    from _stores import new_conversation

    from agentkv.chat.messages import Message

    sid = await new_conversation(store)
    token = await store.acquire_lease(sid, "host-a:1:run001", ttl_s=60)
    for text in ["q1", "a1", "q2"]:
        await store.append_message(sid, Message.user(text), token_count=2, fence=token)
    assert await store.rewind(sid, 2, fence=token) == 1  # the holder rewinds under its own lease
    fork = await store.fork_conversation(sid, at=2, fence=token)
    assert await store.lease_holder(sid) == "host-a:1:run001"  # neither touched the holder's lease
    await store.release_lease(sid, force=True)
    with pytest.raises(LeaseLost):
        await store.rewind(sid, 0, fence=token)
    with pytest.raises(LeaseLost):
        await store.fork_conversation(sid, fence=token)
    with pytest.raises(LeaseLost):
        await store.delete_conversation(fork.id, fence=token + 1)  # the fork's lease was never that token
    figures = CallRecord(conversation_id=sid, prompt_tokens=9, reused_tokens=0, prefix_cache_tokens=0,
                         prefilled_tokens=9,
                         generated_tokens=1, ttft_s=0.1, tpot_s=0.0, kv_tokens=10, kv_bytes=0)
    with pytest.raises(LeaseLost):
        await store.record_call(figures, fence=token)  # nor a lost run's call figures
    assert await store.calls(sid) == []
    assert [m.in_window for m in await store.messages(sid)] == [True, True, False]
    assert len(await store.list_conversations()) == 2
    with pytest.raises(UserError, match="lease_wait_s"):
        Store(store.url, lease_wait_s=-1)


def test_cli_rewind_during_a_live_run_says_a_run_is_live_and_leaves_the_history(tmp_path: Path) -> None:
    from agentkv.cli.app import app

    url = f"sqlite:///{tmp_path / 'a.db'}"

    async def main() -> None:
        store = Store(url)
        agent, started, finish = make_live_run(store)
        runtime = Runtime(ScriptedEngine([call("slow", city="Oslo"), "Oslo: 12 C."]), store)
        conversation = await runtime.open_conversation(agent)
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(runtime.run, conversation, "Weather in Oslo?")
            await started.wait()
            refused = await anyio.to_thread.run_sync(
                CliRunner().invoke, app, ["conversations", "rewind", conversation.id, "--before", "1", "--db", url])
            assert refused.exit_code == 1, refused.output
            assert "a run is live in it" in refused.output and "retry" in refused.output
            assert await roles(store, conversation.id, in_window_only=True) == ["user", "assistant"]
            finish.set()
        done = await anyio.to_thread.run_sync(
            CliRunner().invoke, app, ["conversations", "rewind", conversation.id, "--before", "3", "--db", url])
        assert done.exit_code == 0 and "2 messages left" in done.output, done.output
        await store.close()

    anyio.run(main)


@pytest.mark.postgres
async def test_prune_keeps_a_conversation_whose_run_took_the_lease_while_prune_chose_what_to_delete(
        store_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL only: SQLite runs one write transaction at a time, so nothing comes between."""
    if not store_url.startswith("postgresql"):
        pytest.skip("SQLite serialises write transactions: a run cannot take the lease mid-prune there")
    from _stores import new_conversation

    from agentkv.memory import queries, retention
    from agentkv.memory.schema import utcnow

    async with Store(store_url, snapshot_dir=tmp_path / "s") as pruner, Store(store_url) as runner:
        sid = await new_conversation(pruner)
        forks_of = retention.branches.forks_of

        def run_takes_the_lease(s, conversation_id):  # after prune read its candidates, before it deletes
            runner.database.write(lambda t: queries.acquire_lease(t, sid, "host-a:1:run001", 60, utcnow()))
            monkeypatch.setattr(retention.branches, "forks_of", forks_of)
            return forks_of(s, conversation_id)

        monkeypatch.setattr(retention.branches, "forks_of", run_takes_the_lease)
        assert (await pruner.prune(older_than=timedelta(0))).conversations == ()
        assert await runner.lease_holder(sid) == "host-a:1:run001"
