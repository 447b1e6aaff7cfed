"""Cache-break attribution: a model call that reuses less KV than its session held says where
(token, message, part), shows both sides, and names the cause — one test per cause — as an event
before its text, in ``RunResult.cache_breaks`` and on the CLI's metrics line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from agentkv import Agent, CacheBroken, GenerationConfig, Runtime, TextDelta, tool
from agentkv.cli.display import TurnPrinter
from agentkv.memory import Store
from agentkv.policies import Truncation
from agentkv.memory.conversation_stats import conversation_stats
from agentkv.testing import ScriptedEngine


@tool
def lookup(term: str) -> str:
    """Look a term up."""
    return term


@tool
def translate(text: str) -> str:
    """Translate a text."""
    return text


AGENT = Agent(name="chat", instructions="Be brief.")


@pytest.fixture
def db(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


async def two_turns(runtime: Runtime, agent: Agent = AGENT):
    session = await runtime.open_conversation(agent)
    await runtime.run(session, "First question?")
    return session


async def test_an_ordinary_conversation_reuses_everything_and_reports_no_break():
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Three."]))
    session = await runtime.open_conversation(AGENT)
    for question in ("A?", "B?", "C?"):
        result = await runtime.run(session, question)
        assert result.cache_breaks == (None,)


async def test_instructions_changed_between_runs():
    runtime = Runtime(ScriptedEngine(["One.", "Two."]))
    session = await two_turns(runtime)
    session.agent = dataclasses.replace(AGENT, instructions="Be very brief.")
    events = [e async for e in runtime.run_stream(session, "Second?")]
    [broken] = [e for e in events if isinstance(e, CacheBroken)]
    assert events.index(broken) < next(i for i, e in enumerate(events) if isinstance(e, TextDelta))
    found = broken.cache_break
    assert (found.cause, found.part, found.message_index, found.role) == (
        "instructions changed", "system prompt", 0, "system")
    assert "brief" in found.kv_excerpt and "very" in found.prompt_excerpt
    assert found.discarded > 0 and events[-1].result.cache_breaks == (found,)


async def test_tool_schemas_changed_between_runs():
    agent = Agent(name="tools", instructions="Be brief.", tools=[lookup])
    runtime = Runtime(ScriptedEngine(["One.", "Two."]))
    session = await two_turns(runtime, agent)
    session.agent = dataclasses.replace(agent, tools=(lookup, translate))
    found = (await runtime.run(session, "Second?")).cache_breaks[0]
    assert found.cause == "tool schemas changed" and found.part == "tool schemas"


async def test_a_window_compaction(db):
    agent = Agent(name="small", instructions="Be brief.", policy=Truncation(), max_prompt_len=80, min_response_len=16)
    runtime = Runtime(ScriptedEngine(["word " * 20, "word " * 20]))
    session = await runtime.open_conversation(agent)
    assert (await runtime.run(session, "First " * 10)).cache_breaks == (None,)
    found = (await runtime.run(session, "Second " * 10)).cache_breaks[0]  # the first exchange leaves
    assert found is not None and found.cause == "window compaction" and found.message_index == 1
    assert "First" in found.kv_excerpt and "Second" in found.prompt_excerpt


async def test_a_rewind_reports_the_kv_it_dropped_at_the_next_call(db):
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Three."]), Store(db))
    session = await two_turns(runtime)
    await runtime.run(session, "Second?")
    await runtime.rewind(session, before=3)
    found = (await runtime.run(session, "Another?")).cache_breaks[0]
    assert found.cause == "rewind" and found.role == "user" and "Second" in found.kv_excerpt
    assert found.message_index == 3  # system, First?, One., then the rewound message


async def test_an_edit_reports_the_replaced_message(db):
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Edited."]), Store(db))
    session = await two_turns(runtime)
    await runtime.run(session, "Second?")
    branch, result = await runtime.edit(session, 3, "Rephrased?")
    found = result.cache_breaks[0]
    assert found.cause == "edit" and "Second" in found.kv_excerpt


async def test_re_render_drift_same_text_other_tokens():
    engine = ScriptedEngine(["Hello there.", "Fine."])
    runtime = Runtime(engine)
    session = await two_turns(runtime)
    answer = session.window[-1]
    tok = engine.tokenizer
    respelled = tuple(tok.encode("Hel") + tok.encode("lo there.") + tok.encode("<|im_end|>"))
    assert tok.decode(list(respelled)) == tok.decode(list(answer.message.token_ids))
    answer.message = answer.message.model_copy(update={"token_ids": respelled})
    found = (await runtime.run(session, "How are you?")).cache_breaks[0]
    assert found.cause == "re-render drift" and found.role == "assistant" and found.part == "content"


async def test_a_restore_that_falls_short(db):
    first = Runtime(ScriptedEngine(["One."]), Store(db))
    session = await two_turns(first)
    store = Store(db)
    for record in await store.snapshots(session.id):
        await store.delete_snapshot(record)  # the KV is gone: the history must be prefilled again
    later = Runtime(ScriptedEngine(["Two."]), store, agents=[AGENT])
    resumed = await later.resume(session.id)
    found = (await later.run(resumed, "Second?")).cache_breaks[0]
    assert found.cause == "partial restore" and found.position == 0 and found.held > 0


async def test_the_cli_metrics_line_shows_the_break(capsys):
    from rich.console import Console

    runtime = Runtime(ScriptedEngine(["One.", "Two."]))
    session = await two_turns(runtime)
    session.agent = dataclasses.replace(AGENT, instructions="Other.")
    err = Console(stderr=True, width=300)
    printer = TurnPrinter(Console(width=300), err, metrics=True, eos_token_id=None, max_new_tokens=64)
    async for event in runtime.run_stream(session, "Second?"):
        printer.show(event)
    assert "cause: instructions changed" in capsys.readouterr().err


CUT = Agent(name="cut", instructions="Be brief.", generation=GenerationConfig(max_new_tokens=3))


async def test_a_resume_after_an_answer_cut_by_max_new_tokens_reports_no_break(db):
    first = Runtime(ScriptedEngine(["One two three four five six."]), Store(db))
    session = await first.open_conversation(CUT)
    assert (await first.run(session, "First?")).finish_reason == "length"
    store = Store(db)
    later = Runtime(ScriptedEngine(["Two."]), store, agents=[CUT])
    resumed = await later.resume(session.id)
    [held] = [r.num_tokens for r in await store.snapshots(session.id)][:1]
    result = await later.run(resumed, "Second?")
    assert result.call_metrics[0].reused_tokens == held  # every token of KV the snapshot held was reused
    assert result.cache_breaks == (None,)
    assert (await conversation_stats(store, session.id)).cache_breaks == ()  # `conversations show --kv` counts none


async def test_a_restore_of_an_older_snapshot_than_the_newest_is_a_break(db):
    store = Store(db, keep_snapshots=2)
    first = Runtime(ScriptedEngine(["One.", "Two."]), store)
    session = await two_turns(first, AGENT)
    await first.run(session, "Second question?")
    newest, older = await store.snapshots(session.id)
    newest.path.write_bytes(newest.path.read_bytes()[:100])  # the newest is damaged: the older comes back
    later = Runtime(ScriptedEngine(["Three."]), Store(db), agents=[AGENT])
    resumed = await later.resume(session.id)
    assert resumed.resume_report.restored_tokens == older.num_tokens
    found = (await later.run(resumed, "Third?")).cache_breaks[0]
    assert found.cause == "partial restore" and (found.position, found.held) == (older.num_tokens, newest.num_tokens)


async def test_a_resume_after_a_rewind_reports_no_break_for_the_kv_the_rewind_let_go(db):
    store = Store(db)
    first = Runtime(ScriptedEngine(["One.", "Two."]), store)
    session = await two_turns(first, AGENT)
    await first.run(session, "Second question?")
    assert await first.rewind(session, before=3) == 2  # the second exchange leaves; no new snapshot
    later = Runtime(ScriptedEngine(["Three."]), Store(db), agents=[AGENT])
    resumed = await later.resume(session.id)
    assert resumed.resume_report.restored_tokens > 0
    assert (await later.run(resumed, "Another question?")).cache_breaks == (None,)
    assert (await conversation_stats(store, session.id)).cache_breaks == ()
