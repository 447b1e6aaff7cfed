"""Persistence end to end: crash safety, resume from a KV snapshot in a new process, corrupt
snapshots, cross-process leases, and the CLI."""

from __future__ import annotations

import errno
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentkv import Agent, Runtime
from agentkv.errors import SessionBusy, SessionNotFound, UserError
from agentkv.engine.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

WORKER = str(Path(__file__).with_name("_persistence_worker.py"))
AGENT = Agent(name="persist", instructions="You are a terse assistant.")
ROOT = Path(__file__).resolve().parents[1]


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)


def wait_for_user_message(url: str, session_id: str, timeout: float = 60.0) -> None:
    async def poll() -> bool:
        async with Store(url) as store:
            try:
                return bool(await store.messages(session_id))
            except SessionNotFound:
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
            with pytest.raises(SessionBusy):
                await runtime.run(session, "me too")
    finally:
        worker.kill()
        worker.wait(timeout=30)


async def test_resume_unknown_session_raises_session_not_found(tmp_path):
    async with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        runtime = Runtime(ScriptedEngine([]), store, agents=[AGENT])
        with pytest.raises(SessionNotFound):
            await runtime.resume("nope")


@pytest.mark.model
async def test_resume_in_a_new_process_restores_the_kv_and_answers_as_the_original(engine, tmp_path):
    original = tmp_path / "a"
    original.mkdir()
    url_a = f"sqlite:///{original / 'agentkv.db'}"
    store = Store(url_a)
    runtime = Runtime(engine, store, agents=[AGENT])
    session = await runtime.open_session(AGENT, session_id="resume-me")
    await runtime.run(session, "Name three colours.")
    await runtime.aclose()
    await store.close()
    copy = tmp_path / "b"
    shutil.copytree(original, copy)
    # Continue in this process...
    store = Store(url_a)
    runtime = Runtime(engine, store, agents=[AGENT])
    session = await runtime.resume("resume-me")
    expected = await runtime.run(session, "Now name three animals.")
    await runtime.aclose()
    await store.close()
    # ...and in a fresh process from the copied database and snapshot files.
    done = await anyio.run_process(
        [sys.executable, WORKER, "resume-turn", f"sqlite:///{copy / 'agentkv.db'}", "resume-me",
         "Now name three animals."], cwd=ROOT, check=True)
    report = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert report["text"] == expected.final_text
    assert report["restored"] > 0
    assert report["reused"] >= report["restored"]
    new_turn = len(engine.tokenizer.encode("Now name three animals.")) + 12
    assert report["prefilled"] <= new_turn  # only the new user turn, not the history


@pytest.mark.model
@pytest.mark.parametrize("backend", ["stateful", "paged"])
async def test_corrupt_snapshot_falls_back_to_reprefill_and_loses_nothing(backend, request, tmp_path):
    """The re-prefilled session answers as the intact KV would — on the stateful engine, whose
    decode steps and prefills compute the same KV for this model. On the paged engine a decode
    step runs another kernel than a prefill (~0.6 max abs logit apart, measured), so the KV of
    the answer re-prefilled is close to, not equal to, the decoded one: there the re-prefilled
    session must answer as a fresh prefill of the same history does."""
    engine = request.getfixturevalue(f"{backend}_engine")
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_session(AGENT, session_id="c")
        await runtime.run(session, "Say hi.")
        reference = await (session.kv.fork() if backend == "stateful" else engine.open_session())
        await runtime.aclose()
        (record,) = (await store.snapshots("c"))[:1]
        data = bytearray(record.path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.path.write_bytes(bytes(data))
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.resume("c")
        assert session.resume_report.restored_tokens == 0
        assert session.resume_report.skipped_snapshots
        result = await runtime.run(session, "Say bye.")
        assert result.step_metrics[0].reused_tokens == 0  # re-prefilled
        # the same answer the intact KV gives
        prompt = session.render(AGENT).token_ids
        assert len([m for m in await store.messages("c")]) == 4
        expected_prompt = prompt[: result.step_metrics[0].prompt_tokens]
        check = await reference.generate(expected_prompt, AGENT.generation)
        assert check.text == result.final_text
        await reference.close()
        await runtime.aclose()


@pytest.mark.model
def test_cli_chat_then_sessions_list_then_resume(tmp_path):
    from typer.testing import CliRunner

    from agentkv.cli import app

    db = f"sqlite:///{tmp_path / 'cli.db'}"
    runner = CliRunner()
    first = runner.invoke(app, ["chat", "--db", db, "--metrics"], input="Hello there.\n")
    assert first.exit_code == 0, first.output
    session_id = next(line.split()[1] for line in first.output.splitlines() if line.startswith("session "))
    listing = runner.invoke(app, ["sessions", "list", "--db", db])
    assert session_id in listing.output
    again = runner.invoke(app, ["resume", session_id, "--db", db], input="And again.\n")
    assert again.exit_code == 0, again.output
    assert "resumed session" in again.output
    exported = runner.invoke(app, ["sessions", "export", session_id, "--db", db])
    roles = [json.loads(line)["role"] for line in exported.output.splitlines() if line.strip()]
    assert roles == ["system", "user", "assistant", "user", "assistant"]  # the agent's system prompt first
    gone = runner.invoke(app, ["sessions", "rm", session_id, "--db", db])
    assert gone.exit_code == 0
    missing = runner.invoke(app, ["sessions", "show", session_id, "--db", db])
    assert missing.exit_code == 1 and "no session" in missing.output


async def test_a_second_run_in_the_same_process_does_not_release_the_first_runs_lease(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        engine = ScriptedEngine(["one " * 30, "two"], decode_s_per_token=0.01)
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_session(AGENT, session_id="lease")
        async with anyio.create_task_group() as tg:
            tg.start_soon(runtime.run, session, "first")
            await anyio.sleep(0.05)
            with pytest.raises(SessionBusy):
                await runtime.run(session, "second")
            # the first run still holds the lease: another process is refused
            with pytest.raises(SessionBusy):
                await store.acquire_lease("lease", "another-process", 60)


async def test_a_cancelled_run_saves_a_snapshot_that_resume_can_use(tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        engine = ScriptedEngine(["short answer", "word " * 200], decode_s_per_token=0.01)
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_session(AGENT, session_id="cut")
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
        a = await first.open_session(AGENT, session_id="shared")
        await first.run(a, "hello one")
        b = await second.resume("shared")
        await second.run(b, "hello two")
        await first.run(a, "back to one")
        contents = [m.content for m in a.messages]
        assert contents == ["hello one", "from one", "hello two", "from two", "back to one", "one again"]
        assert [m.message.content for m in await store.messages("shared")] == contents


async def test_resume_of_an_open_session_applies_the_agent_it_is_given_and_refuses_another_salt(tmp_path):
    runtime = Runtime(ScriptedEngine(["One."]), Store(f"sqlite:///{tmp_path / 'a.db'}"))
    session = await runtime.open_session(AGENT, salt="team-a")
    assert await runtime.resume(session.id, salt="team-a") is session
    assert session.agent is AGENT  # no agent given: the one it runs with stays
    other = Agent(name="other", instructions="Be verbose.")
    assert await runtime.resume(session.id, other, salt="team-a") is session
    assert session.agent is other  # as a resume of the closed session would run it
    with pytest.raises(UserError, match="tenant salt 'team-a', not 'team-b'.*close_session"):
        await runtime.resume(session.id, salt="team-b")
    assert session.agent is other and session.salt == "team-a"
    await runtime.close_session(session)
    reopened = await runtime.resume(session.id, other, salt="team-b")  # closed first: both apply
    assert reopened.agent is other and reopened.salt == "team-b"


def disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_snapshot_save_on_a_full_disk_is_one_true_warning_line_per_turn(tmp_path, monkeypatch, caplog):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Three."]), Store(url))
    session = await runtime.open_session(AGENT)
    await runtime.run(session, "First?")
    [saved] = await runtime.store.snapshots(session.id)
    monkeypatch.setattr(KVSnapshot, "to_file", disk_full)
    for question in ("Second?", "Third?"):
        caplog.clear()
        await runtime.run(session, question)
        [line] = [r for r in caplog.records if r.name == "agentkv.persistence"]
        assert line.exc_info is None and "\n" not in line.getMessage()
        assert "No space left on device" in line.getMessage()
        assert f"a resume will use the older snapshot of {saved.num_tokens} tokens" in line.getMessage()
    later = Runtime(ScriptedEngine([]), Store(url), agents=[AGENT])
    assert (await later.resume(session.id)).resume_report.restored_tokens == saved.num_tokens  # it was true


async def test_a_failed_first_snapshot_says_no_older_snapshot_exists(tmp_path, monkeypatch, caplog):
    runtime = Runtime(ScriptedEngine(["One."]), Store(f"sqlite:///{tmp_path / 'a.db'}"))
    session = await runtime.open_session(AGENT)
    monkeypatch.setattr(KVSnapshot, "to_file", disk_full)
    await runtime.run(session, "First?")
    [line] = [r for r in caplog.records if r.name == "agentkv.persistence"]
    assert line.exc_info is None and "no older snapshot exists" in line.getMessage()
