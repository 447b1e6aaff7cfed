"""Tools the caller executes (raw OpenAI schemas) and runs that start from OpenAI messages, on
the scripted engine: the run stops at such calls, the caller's results continue it on the same
KV, and input that cannot follow the history is refused before anything is recorded."""

from __future__ import annotations

import json

import pytest

from agentkv import Agent, Message, Runtime, tool
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.errors import UserError
from agentkv.events import RunFinished, ToolCalled
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


async def open_session(engine, agent, store=None):
    runtime = Runtime(engine, store=store)
    return runtime, await runtime.open_conversation(agent)


def test_a_raw_openai_schema_makes_a_tool_the_caller_executes_in_either_layout():
    nested = tool(WEATHER)
    flat = tool({"type": "function", **WEATHER["function"]})  # the Responses API's layout
    for made in (nested, flat):
        assert made.is_external and made.name == "get_weather"
        assert made.schema_for_prompt() == {**WEATHER, "function": {**WEATHER["function"]}}
    agent = Agent(name="w", tools=[WEATHER, add])
    assert [t.is_external for t in agent.tools] == [True, False]
    with pytest.raises(UserError, match="the caller executes it"):
        nested(city="Paris")


@pytest.mark.parametrize("schema, complaint", [
    ({"type": "function", "function": {"name": "bad name"}}, "not allowed"),
    ({"type": "function", "function": {"description": "no name"}}, "function.name"),
    ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}, '"object"'),
    ({"type": "retrieval"}, '"function" tools'),
    ({"type": "function", "function": {"name": "f", "colour": "red"}}, "colour"),
])
def test_a_schema_the_format_cannot_carry_is_refused_with_what_is_wrong(schema, complaint):
    with pytest.raises(UserError, match=complaint):
        tool(schema)
    with pytest.raises(UserError, match=complaint):
        Agent(name="a", tools=[schema])


async def test_a_run_stops_at_a_caller_executed_call_and_the_results_continue_it_on_the_same_kv():
    engine = ScriptedEngine([call("get_weather", city="Paris"), "It is 18 C in Paris."])
    runtime, session = await open_session(engine, Agent(name="w", tools=[WEATHER]))
    first = await runtime.run(session, "Weather in Paris?")
    assert first.finish_reason == "tool_calls" and first.final_text == ""
    [pending] = first.pending_tool_calls
    assert pending.name == "get_weather" and pending.arguments == {"city": "Paris"}
    assert [m.role for m in session.messages] == ["user", "assistant"]
    second = await runtime.run(session, [{"role": "tool", "tool_call_id": pending.id, "content": "18 C"}])
    assert second.finish_reason == "stop" and second.final_text == "It is 18 C in Paris."
    assert [m.role for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[2].name == "get_weather"  # named after the call it answers
    [step] = second.call_metrics
    assert step.reused_tokens >= first.call_metrics[0].prompt_tokens and step.prefilled_tokens < 40
    engine.assert_complete()


async def test_in_one_step_the_agents_own_tools_run_and_only_the_callers_calls_wait():
    engine = ScriptedEngine([call("add", a=2, b=3) + "\n" + call("get_weather", city="Oslo"), "5, and 3 C."])
    runtime, session = await open_session(engine, Agent(name="w", tools=[add, WEATHER]))
    events = [event async for event in runtime.run_stream(session, "2+3, and Oslo's weather?")]
    result = events[-1].result
    assert isinstance(events[-1], RunFinished) and result.finish_reason == "tool_calls"
    assert [c.name for c in result.pending_tool_calls] == ["get_weather"]
    assert [e.call.name for e in events if isinstance(e, ToolCalled)] == ["add", "get_weather"]
    assert [(m.role, m.content) for m in session.messages if m.role == "tool"] == [("tool", "5")]
    done = await runtime.run(session, [{"role": "tool", "tool_call_id": result.pending_tool_calls[0].id,
                                        "content": "3 C"}])
    assert done.final_text == "5, and 3 C."


async def test_input_that_cannot_follow_pending_calls_is_refused_and_records_nothing():
    engine = ScriptedEngine([call("get_weather", city="Rome") + "\n" + call("get_weather", city="Bern"), "ok"])
    runtime, session = await open_session(engine, Agent(name="w", tools=[WEATHER]))
    first = await runtime.run(session, "Rome and Bern?")
    rome, bern = first.pending_tool_calls
    before = list(session.messages)
    refused = [
        ("A new question", "pending tool calls"),
        ([{"role": "user", "content": "hi"}], "before the results"),
        ([{"role": "tool", "tool_call_id": "call_nope", "content": "x"}], "answers no pending"),
        ([{"role": "tool", "tool_call_id": rome.id, "content": "20 C"}], "still need results"),
        ([{"role": "tool", "tool_call_id": rome.id, "content": "20 C"},
          {"role": "tool", "tool_call_id": rome.id, "content": "again"}], "answers no pending"),
        ([{"role": "system", "content": "Be rude."}], "agent's instructions"),
        ([], "needs a user message"),
        ([{"role": "critic", "content": "x"}], "message 0"),
    ]
    for run_input, complaint in refused:
        with pytest.raises(UserError, match=complaint):
            await runtime.run(session, run_input)
        assert list(session.messages) == before
    done = await runtime.run(session, [{"role": "tool", "tool_call_id": bern.id, "content": "15 C"},
                                       {"role": "tool", "tool_call_id": rome.id, "content": "20 C"}])
    assert done.final_text == "ok"


async def test_a_run_can_start_from_openai_messages_with_history_the_client_kept():
    engine = ScriptedEngine(["Four."])
    agent = Agent(name="m", instructions="Be brief.")
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "2+2?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 2, \"b\": 2}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4"},
    ])
    assert result.final_text == "Four."
    assert [m.role for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[2].name == "add"
    exported = [m.to_openai() for m in session.messages]
    assert exported[1]["content"] is None and exported[1]["tool_calls"][0]["id"] == "c1"
    assert messages_from_openai(exported) == [m.model_copy(update={"token_ids": None}) for m in session.messages]


def test_openai_messages_with_bad_arguments_say_which_message_and_call():
    with pytest.raises(UserError, match="message 0: tool call c1 has arguments that are not JSON"):
        messages_from_openai([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(UserError, match="message 1 must be a dict"):
        messages_from_openai([Message.user("hi"), "hello"])


async def test_with_a_store_pending_caller_calls_are_not_marked_interrupted_by_the_next_run(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshot_dir=tmp_path / "snaps")
    engine = ScriptedEngine([call("get_weather", city="Lima"), "Warm."])
    runtime, session = await open_session(engine, Agent(name="w", tools=[WEATHER]), store=store)
    first = await runtime.run(session, "Lima?")
    [pending] = first.pending_tool_calls
    done = await runtime.run(session, [{"role": "tool", "tool_call_id": pending.id, "content": "25 C"}])
    assert done.final_text == "Warm."
    stored = [m.message for m in await store.messages(session.id) if m.message.role == "tool"]
    assert [m.content for m in stored] == ["25 C"]
    await runtime.aclose()
    await store.close()


async def test_an_agent_without_instructions_renders_no_system_turn_and_an_empty_one_renders_it():
    engine = ScriptedEngine(["hi", "hi"])
    bare = Agent(name="bare", instructions=None)
    empty = Agent(name="empty", instructions="")
    runtime = Runtime(engine)
    for agent, start in ((bare, "<|im_start|>user\n"), (empty, "<|im_start|>system\n<|im_end|>\n")):
        session = await runtime.open_conversation(agent)
        await runtime.run(session, "hello")
        assert engine.calls[-1].prompt_text.startswith(start)
    with pytest.raises(UserError, match="instructions must be a string, or None"):
        Agent(name="bad", instructions=42)  # type: ignore[arg-type]


