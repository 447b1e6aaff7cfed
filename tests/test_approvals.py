"""Tool calls that wait for a person: the run stops with ``approval_required`` and keeps its KV; an
approval runs the call and the model continues prefilling only the result — also after a restart;
a rejection tells the model; nothing else may jump the queue."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

from agentkv import Agent, ApprovalRequired, Decisions, RunFinished, Runtime, tool
from agentkv.cli.app import app
from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

deleted: list[str] = []


@tool(requires_approval=True)
def delete_file(path: str) -> str:
    """Delete a file."""
    deleted.append(path)
    return f"deleted {path}"


@tool
def list_files() -> str:
    """List the files."""
    return "a.txt b.txt"


@tool
def pay(amount: int) -> str:
    """Pay an amount."""
    return f"paid {amount}"


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def calls(*made: str) -> str:
    return "\n".join(made)


AGENT = Agent(name="files", tools=[delete_file, list_files])


@pytest.fixture(autouse=True)
def nothing_deleted():
    deleted.clear()


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


async def test_a_call_needing_approval_stops_the_run_and_an_approval_continues_on_the_same_kv(db):
    engine = ScriptedEngine([call("delete_file", path="a.txt"), "Deleted a.txt."])
    runtime = Runtime(engine, Store(db))
    session = await runtime.open_conversation(AGENT)
    events = [event async for event in runtime.run_stream(session, "Delete a.txt")]
    result = events[-1].result
    assert isinstance(events[-2], ApprovalRequired) and isinstance(events[-1], RunFinished)
    assert result.finish_reason == "approval_required" and deleted == []
    [waiting] = result.pending_approvals
    assert waiting.name == "delete_file" and runtime.pending_approvals(session) == (waiting,)
    done = await runtime.approve(session, waiting.id)
    assert deleted == ["a.txt"] and done.final_text == "Deleted a.txt." and done.finish_reason == "stop"
    result_turn = session.render_with(AGENT, [session.messages[-2]]).token_ids  # only the tool result is new
    assert done.call_metrics[0].prefilled_tokens <= len(result_turn)
    assert runtime.pending_approvals(session) == ()
    engine.assert_complete()


async def test_an_approval_survives_a_restart_and_the_continuation_prefills_only_the_result(db):
    first = Runtime(ScriptedEngine([call("delete_file", path="b.txt")]), Store(db))
    session = await first.open_conversation(AGENT)
    waiting = (await first.run(session, "Delete b.txt")).pending_approvals[0]
    history_tokens = len(session.kv.tokens)
    # another process, later: a new engine, runtime and store on the same database
    engine = ScriptedEngine(["Done."])
    later = Runtime(engine, Store(db), agents=[AGENT])
    resumed = await later.resume(session.id)
    assert resumed.resume_report.interrupted_calls == 0  # waiting, not orphaned
    assert [c.id for c in later.pending_approvals(resumed)] == [waiting.id]
    done = await later.approve(resumed, waiting.id)
    assert deleted == ["b.txt"] and done.final_text == "Done."
    metrics = done.call_metrics[0]
    assert metrics.reused_tokens >= history_tokens - 2 and metrics.prefilled_tokens < 30
    assert "deleted b.txt" in engine.calls[0].prompt_text


async def test_a_rejection_reaches_the_model_with_its_reason():
    engine = ScriptedEngine([call("delete_file", path="a.txt"), "Understood, I kept it."])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(AGENT)
    waiting = (await runtime.run(session, "Delete a.txt")).pending_approvals[0]
    done = await runtime.reject(session, waiting.id, "it is still needed")
    assert deleted == [] and done.final_text == "Understood, I kept it."
    assert "rejected this call: it is still needed" in engine.calls[1].prompt_text


async def test_nothing_jumps_calls_waiting_for_approval_and_nothing_is_recorded():
    runtime = Runtime(ScriptedEngine([call("delete_file", path="a.txt")]))
    session = await runtime.open_conversation(AGENT)
    waiting = (await runtime.run(session, "Delete a.txt")).pending_approvals[0]
    before = list(session.messages)
    with pytest.raises(UserError, match="waiting for approval: delete_file"):
        await runtime.run(session, "Never mind")
    with pytest.raises(UserError, match="not waiting for approval"):
        await runtime.approve(session, "call_unknown")
    with pytest.raises(UserError, match="both approved and rejected"):
        Decisions(approve=[waiting.id], reject={waiting.id: "no"})
    assert session.messages == before and deleted == []


async def test_free_calls_run_at_once_and_each_decision_continues_only_when_none_waits():
    engine = ScriptedEngine([calls(call("list_files"), call("delete_file", path="a.txt"),
                                   call("delete_file", path="b.txt")), "Deleted a.txt only."])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(AGENT)
    result = await runtime.run(session, "Clean up")
    assert [m.content for m in result.new_messages if m.role == "tool"] == ["a.txt b.txt"]
    first, second = result.pending_approvals
    partial = await runtime.approve(session, first.id)
    assert partial.finish_reason == "approval_required" and partial.pending_approvals == (second,)
    assert partial.call_metrics == ()  # no model call while a call waits
    done = await runtime.reject(session, second.id, "keep b")
    assert done.final_text == "Deleted a.txt only." and deleted == ["a.txt"]
    engine.assert_complete()


async def test_an_agents_predicate_picks_which_calls_wait():
    agent = Agent(name="payer", tools=[pay], needs_approval=lambda c: c.name == "pay" and c.arguments["amount"] > 100)
    engine = ScriptedEngine([call("pay", amount=20), "Paid 20.", call("pay", amount=500)])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(agent)
    assert (await runtime.run(session, "Pay 20")).final_text == "Paid 20."
    big = await runtime.run(session, "Pay 500")
    assert big.finish_reason == "approval_required" and big.pending_approvals[0].arguments == {"amount": 500}


def test_cli_lists_the_calls_waiting_in_stored_sessions(db):
    async def stop_on_approval():
        runtime = Runtime(ScriptedEngine([call("delete_file", path="a.txt")]), Store(db))
        session = await runtime.open_conversation(AGENT)
        return (await runtime.run(session, "Delete a.txt")).pending_approvals[0]

    waiting = anyio.run(stop_on_approval)
    result = CliRunner().invoke(app, ["conversations", "pending", "--db", db], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and waiting.id in result.output and "delete_file" in result.output
    empty = CliRunner().invoke(app, ["conversations", "pending", "--db", f"{db}-other"])
    assert "no tool call is waiting" in empty.output
