"""Persistence end to end: crash safety, resume from a KV snapshot in a new process, corrupt
snapshots, cross-process leases, and the CLI."""

from __future__ import annotations

import errno
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentkv import Agent, Runtime
from agentkv.errors import ConversationBusy, ConversationNotFound, UserError
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

WORKER = str(Path(__file__).with_name("_persistence_worker.py"))
AGENT = Agent(name="persist", instructions="You are a terse assistant.")
ROOT = Path(__file__).resolve().parents[1]


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def wait_for_user_message(url: str, conversation_id: str, timeout: float = 60.0) -> None:
    async def poll() -> bool:
        async with Store(url) as store:
            try:
                return bool(await store.messages(conversation_id))
            except ConversationNotFound:
                return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if anyio.run(poll):
            return
        time.sleep(0.1)
    raise AssertionError("the worker never recorded the user message")


async def test_sigkill_mid_generation_keeps_the_user_message_and_the_session_resumes(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    worker = spawn("slow-turn", url, "crash")
    try:
        await anyio.to_thread.run_sync(wait_for_user_message, url, "crash")
        await anyio.sleep(0.3)  # mid-generation
        worker.send_signal(signal.SIGKILL)
    finally:
        worker.wait(timeout=30)
    async with Store(url) as store:
        stored = await store.messages("crash")
        assert [(m.seq, m.message.role, m.message.content) for m in stored] == [(1, "user", "tell me everything")]
        await anyio.sleep(1.1)  # the dead worker's lease expires
        runtime = Runtime(ScriptedEngine(["back again"]), store, agents=[AGENT])
        session = await runtime.resume("crash")
        assert [m.role for m in session.messages] == ["user"]
        result = await runtime.run(session, "are you there?")
        assert result.final_text == "back again"
        assert [m.message.role for m in await store.messages("crash")] == ["user", "user", "assistant"]


async def test_a_second_process_on_a_running_session_gets_session_busy(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    worker = spawn("slow-turn", url, "busy")
    try:
        await anyio.to_thread.run_sync(wait_for_user_message, url, "busy")
        async with Store(url) as store:
            runtime = Runtime(ScriptedEngine(["never"]), store, agents=[AGENT])
            session = await runtime.resume("busy")
            with pytest.raises(ConversationBusy):
                await runtime.run(session, "me too")
    finally:
        worker.kill()
        worker.wait(timeout=30)


async def test_resume_unknown_session_raises_session_not_found(tmp_path):
    async with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        runtime = Runtime(ScriptedEngine([]), store, agents=[AGENT])
        with pytest.raises(ConversationNotFound):
            await runtime.resume("nope")


async def test_a_second_run_in_the_same_process_does_not_release_the_first_runs_lease(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        engine = ScriptedEngine(["one " * 30, "two"], decode_s_per_token=0.01)
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_conversation(AGENT, conversation_id="lease")
        async with anyio.create_task_group() as tg:
            tg.start_soon(runtime.run, session, "first")
            await anyio.sleep(0.05)
            with pytest.raises(ConversationBusy):
                await runtime.run(session, "second")
            # the first run still holds the lease: another process is refused
            with pytest.raises(ConversationBusy):
                await store.acquire_lease("lease", "another-process", 60)


async def test_a_cancelled_run_saves_a_snapshot_that_resume_can_use(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        engine = ScriptedEngine(["short answer", "word " * 200], decode_s_per_token=0.01)
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_conversation(AGENT, conversation_id="cut")
        await runtime.run(session, "hello")
        with anyio.move_on_after(0.3):
            await runtime.run(session, "tell me a lot")
        newest = (await store.snapshots("cut"))[0]
        history = session.render(AGENT, add_generation_prompt=False).token_ids
        assert 0 < newest.num_tokens <= len(history)
        again = Runtime(ScriptedEngine([]), store, agents=[AGENT])
        resumed = await again.resume("cut")
        assert resumed.resume_report.restored_tokens == newest.num_tokens


async def test_a_session_open_in_two_runtimes_sees_the_turns_the_other_ran(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        first = Runtime(ScriptedEngine(["from one", "one again"]), store, agents=[AGENT])
        second = Runtime(ScriptedEngine(["from two"]), store, agents=[AGENT])
        a = await first.open_conversation(AGENT, conversation_id="shared")
        await first.run(a, "hello one")
        b = await second.resume("shared")
        await second.run(b, "hello two")
        await first.run(a, "back to one")
        contents = [m.content for m in a.messages]
        assert contents == ["hello one", "from one", "hello two", "from two", "back to one", "one again"]
        assert [m.message.content for m in await store.messages("shared")] == contents


async def test_resume_of_an_open_session_applies_the_agent_it_is_given_and_refuses_another_salt(tmp_path):
    runtime = Runtime(ScriptedEngine(["One."]), Store(f"sqlite:///{tmp_path / 'a.db'}"))
    session = await runtime.open_conversation(AGENT, salt="team-a")
    assert await runtime.resume(session.id, salt="team-a") is session
    assert session.agent is AGENT  # no agent given: the one it runs with stays
    other = Agent(name="other", instructions="Be verbose.")
    assert await runtime.resume(session.id, other, salt="team-a") is session
    assert session.agent is other  # as a resume of the closed session would run it
    with pytest.raises(UserError, match="tenant salt 'team-a', not 'team-b'.*close_conversation"):
        await runtime.resume(session.id, salt="team-b")
    assert session.agent is other and session.salt == "team-a"
    await runtime.close_conversation(session)
    reopened = await runtime.resume(session.id, other, salt="team-b")  # closed first: both apply
    assert reopened.agent is other and reopened.salt == "team-b"


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_snapshot_save_on_a_full_disk_is_one_true_warning_line_per_turn(tmp_path, monkeypatch, caplog):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Three."]), Store(url))
    session = await runtime.open_conversation(AGENT)
    await runtime.run(session, "First?")
    [saved] = await runtime.store.snapshots(session.id)
    monkeypatch.setattr(KVSnapshot, "to_file", disk_full)
    for question in ("Second?", "Third?"):
        caplog.clear()
        await runtime.run(session, question)
        [line] = [r for r in caplog.records if r.name == "agentkv.runtime.persistence"]
        assert line.exc_info is None and "\n" not in line.getMessage()
        assert "No space left on device" in line.getMessage()
        assert f"a resume will use the older snapshot of {saved.num_tokens} tokens" in line.getMessage()
    later = Runtime(ScriptedEngine([]), Store(url), agents=[AGENT])
    assert (await later.resume(session.id)).resume_report.restored_tokens == saved.num_tokens  # it was true


async def test_a_failed_first_snapshot_says_no_older_snapshot_exists(tmp_path, monkeypatch, caplog):
    runtime = Runtime(ScriptedEngine(["One."]), Store(f"sqlite:///{tmp_path / 'a.db'}"))
    session = await runtime.open_conversation(AGENT)
    monkeypatch.setattr(KVSnapshot, "to_file", disk_full)
    await runtime.run(session, "First?")
    [line] = [r for r in caplog.records if r.name == "agentkv.runtime.persistence"]
    assert line.exc_info is None and "no older snapshot exists" in line.getMessage()
