"""Branches: a fork shares its parent's messages without copying them and sees the window as it was
at its fork point; parent and fork go on without cross-talk; the fork's KV comes from the parent's
live KV or snapshot; rewind trims the KV instead of re-prefilling; edit is a fork at the message
before. Real SQLite; the scripted engine where the model adds nothing."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from agentkv import Agent, Runtime
from agentkv.chat.messages import Message
from agentkv.cli.app import app
from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

AGENT = Agent(name="brancher", instructions="Be brief.")


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


def message(index: int) -> Message:
    return Message.user(f"u{index}") if index % 2 else Message.assistant(f"a{index}")


async def stored_conversation(store: Store, count: int) -> str:
    await store.upsert_agent("api", None, [], {})
    session = await store.create_conversation("api")
    for index in range(1, count + 1):
        await store.append_message(session.id, message(index), token_count=2)
    return session.id


def contents(stored) -> list[str]:
    return [m.message.content for m in stored]


def row_count(db: str) -> int:
    engine = create_engine(db)
    with engine.connect() as conn:
        count = conn.execute(text("SELECT count(*) FROM messages")).scalar()
    engine.dispose()
    return int(count)


async def test_a_fork_shares_its_parents_messages_without_copying_and_both_go_on(db):
    store = Store(db)
    parent = await stored_conversation(store, 4)
    fork = await store.fork_conversation(parent, at=2)
    assert (fork.parent_id, fork.fork_seq) == (parent, 2) and row_count(db) == 4
    assert contents(await store.messages(fork.id)) == ["u1", "a2"]
    own = await store.append_message(fork.id, Message.user("fork says"), token_count=2)
    assert own.seq == 3 and own.conversation_id == fork.id
    await store.append_message(parent, Message.user("parent says"), token_count=2)
    assert contents(await store.messages(fork.id)) == ["u1", "a2", "fork says"]
    assert contents(await store.messages(parent)) == ["u1", "a2", "u3", "a4", "parent says"]
    grandchild = await store.fork_conversation(fork.id)  # a fork of a fork, at its end
    await store.append_message(grandchild.id, Message.assistant("deeper"), token_count=2)
    assert contents(await store.messages(grandchild.id)) == ["u1", "a2", "fork says", "deeper"]
    listed = {s.id: (s.parent_id, s.fork_seq) for s in await store.list_conversations()}
    assert listed[fork.id] == (parent, 2) and listed[grandchild.id] == (fork.id, 3) and listed[parent] == (None, None)
    with pytest.raises(UserError, match="has forks"):
        await store.delete_conversation(parent)
    assert len(await store.messages(parent)) == 5  # nothing lost
    with pytest.raises(UserError, match="fork at a seq in 0..5"):
        await store.fork_conversation(parent, at=9)


async def test_each_branch_keeps_its_own_window_of_the_shared_messages(db):
    store = Store(db)
    parent = await stored_conversation(store, 4)
    fork = await store.fork_conversation(parent, at=4)
    # the parent summarises 1-2 after the fork: the fork still has them
    await store.replace_in_window(parent, [1, 2], Message.user("summary"), token_count=2)
    assert contents(await store.messages(parent, in_window_only=True)) == ["u3", "a4", "summary"]
    assert contents(await store.messages(fork.id, in_window_only=True)) == ["u1", "a2", "u3", "a4"]
    # the fork summarises 1-2 itself: the parent's rows stay as the parent has them
    await store.replace_in_window(fork.id, [1, 2], Message.user("fork summary"), token_count=2)
    assert contents(await store.messages(fork.id, in_window_only=True)) == ["u3", "a4", "fork summary"]
    assert contents(await store.messages(parent, in_window_only=True)) == ["u3", "a4", "summary"]
    # a fork of the parent made after the summary sees it
    later = await store.fork_conversation(parent)
    assert contents(await store.messages(later.id, in_window_only=True)) == ["u3", "a4", "summary"]
    # rewinding the fork before its summary puts back what it replaced, for the fork only
    assert await store.rewind(fork.id, 4) == 1
    assert contents(await store.messages(fork.id, in_window_only=True)) == ["u1", "a2", "u3", "a4"]
    assert contents(await store.messages(parent, in_window_only=True)) == ["u3", "a4", "summary"]
    # a truncation in the fork (no replacement) leaves the parent alone too
    await store.mark_out_of_window(fork.id, [3])
    assert contents(await store.messages(fork.id, in_window_only=True)) == ["u1", "a2", "a4"]
    assert "u3" in contents(await store.messages(parent, in_window_only=True))


@settings(max_examples=25, deadline=None)
@given(total=st.integers(1, 8), data=st.data())
def test_a_forks_view_is_its_parents_prefix_then_its_own(total, data):
    at = data.draw(st.integers(0, total), label="at")
    own = data.draw(st.integers(0, 4), label="own")
    later = data.draw(st.integers(0, 3), label="parent appends later")

    async def check() -> None:
        store = Store("sqlite://")
        parent = await stored_conversation(store, total)
        fork = await store.fork_conversation(parent, at=at)
        for index in range(own):
            await store.append_message(fork.id, Message.user(f"f{index}"), token_count=1)
        for index in range(later):
            await store.append_message(parent, Message.user(f"p{index}"), token_count=1)
        expected = [message(i).content for i in range(1, at + 1)] + [f"f{i}" for i in range(own)]
        seen = await store.messages(fork.id)
        assert contents(seen) == expected
        assert [m.seq for m in seen] == list(range(1, at + own + 1))
        assert len(await store.messages(parent)) == total + later

    anyio.run(check)


async def test_a_fork_of_a_live_session_reuses_its_kv_and_goes_its_own_way(db):
    engine = ScriptedEngine(["Paris.", "Berlin.", "Rome."])
    runtime = Runtime(engine, Store(db))
    session = await runtime.open_conversation(AGENT)
    await runtime.run(session, "Capital of France?")
    shared = len(session.kv.tokens)
    branch = await runtime.fork(session)
    assert branch.resume_report.restored_tokens >= shared - 2
    result = await runtime.run(branch, "Capital of Germany?")
    assert result.final_text == "Berlin." and result.call_metrics[0].reused_tokens >= shared - 2
    other = await runtime.run(session, "Capital of Italy?")
    assert other.final_text == "Rome."
    assert "Germany" not in engine.calls[2].prompt_text and "Italy" not in engine.calls[1].prompt_text
    assert [m.content for m in branch.messages][-1] == "Berlin."
    assert [m.content for m in session.messages][-1] == "Rome."


async def test_a_fork_after_a_restart_takes_its_kv_from_the_parents_snapshot(db):
    first = Runtime(ScriptedEngine(["Paris.", "Lyon."]), Store(db))
    session = await first.open_conversation(AGENT)
    await first.run(session, "Capital of France?")
    after_one = len(session.kv.tokens)
    await first.run(session, "Second city?")
    engine = ScriptedEngine(["Marseille."])
    later = Runtime(engine, Store(db), agents=[AGENT])
    branch = await later.fork(session.id, at=2)  # after the first answer: the snapshot covers more
    assert branch.resume_report.restored_tokens >= after_one - 2
    result = await later.run(branch, "Third city?")
    assert result.final_text == "Marseille." and "Second city" not in engine.calls[0].prompt_text
    assert result.call_metrics[0].prefilled_tokens < 20


async def test_rewind_takes_messages_out_of_the_window_and_trims_the_kv(db):
    store = Store(db)
    engine = ScriptedEngine(["One.", "Two.", "Three instead."])
    runtime = Runtime(engine, store)
    session = await runtime.open_conversation(AGENT)
    await runtime.run(session, "First?")
    kept = len(session.kv.tokens)
    await runtime.run(session, "Second?")
    assert await runtime.rewind(session, before=3) == 2
    assert [m.content for m in session.messages] == ["First?", "One."]
    assert len(await store.messages(session.id)) == 4  # stored still
    assert len(session.kv.tokens) >= kept - 2
    result = await runtime.run(session, "Another?")
    assert result.call_metrics[0].reused_tokens >= kept - 2 and result.call_metrics[0].prefilled_tokens < 20
    assert "Second?" not in engine.calls[2].prompt_text


async def test_edit_forks_before_the_message_and_keeps_the_original(db):
    engine = ScriptedEngine(["One.", "Two.", "Edited answer."])
    runtime = Runtime(engine, Store(db))
    session = await runtime.open_conversation(AGENT)
    await runtime.run(session, "First?")
    await runtime.run(session, "Second?")
    branch, result = await runtime.edit(session, 3, "Second, rephrased?")
    assert result.final_text == "Edited answer."
    assert [m.content for m in branch.messages] == ["First?", "One.", "Second, rephrased?", "Edited answer."]
    assert [m.content for m in session.messages] == ["First?", "One.", "Second?", "Two."]
    with pytest.raises(UserError, match="not a user message"):
        await runtime.edit(session, 2, "x")


def test_cli_forks_rewinds_and_lists_the_fork_point(db):
    sid = anyio.run(lambda: stored_conversation(Store(db), 4))
    forked = CliRunner().invoke(app, ["conversations", "fork", sid, "--at", "2", "--db", db])
    assert forked.exit_code == 0, forked.output
    fork_id = forked.output.split()[-1]
    listed = CliRunner().invoke(app, ["conversations", "list", "--db", db], env={"COLUMNS": "250"})
    assert f"{sid[:8]}@2" in listed.output
    rewound = CliRunner().invoke(app, ["conversations", "rewind", sid, "--before", "3", "--db", db])
    assert rewound.exit_code == 0 and "2 messages" in rewound.output
    window = anyio.run(lambda: Store(db).messages(sid, in_window_only=True))
    assert contents(window) == ["u1", "a2"]
    refused = CliRunner().invoke(app, ["conversations", "rm", sid, "--db", db])
    assert refused.exit_code == 1 and "has forks" in refused.output
    assert fork_id
