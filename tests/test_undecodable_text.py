"""Lone surrogates (what undecodable bytes become through surrogateescape, or a JSON ``\\udcff``
escape) never reach rendering or the store: they are replaced by U+FFFD wherever text enters a
conversation — the user's input, a caller's tool results, the model's tool-call arguments and
what a tool returns."""

from __future__ import annotations

import json

from agentkv import Agent, Runtime, tool
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

BROKEN = b"\xff\xfe bad \xc3\x28".decode("utf-8", "surrogateescape")  # what a terminal's stray bytes become


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@tool
def echo(text: str) -> str:
    """Echo the text back."""
    return f"got {text}"


@tool
def stray_bytes() -> str:
    """Return text read from a file with undecodable bytes."""
    return BROKEN


def utf8(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


async def test_a_user_message_with_undecodable_bytes_is_stored_with_replacement_characters(tmp_path):
    async with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        runtime = Runtime(ScriptedEngine(["Hi."]), store=store)
        session = await runtime.open_conversation(Agent(name="a"))
        result = await runtime.run(session, BROKEN)
        stored = await store.messages(session.id)
    assert result.final_text == "Hi."
    replaced = BROKEN.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    assert [s.message.content for s in stored] == [replaced, "Hi."]


async def test_tool_arguments_and_results_with_lone_surrogates_are_replaced_and_the_run_finishes():
    engine = ScriptedEngine([call("echo", text="caf\udcc3"), call("stray_bytes"), "Done."])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(Agent(name="a", tools=[echo, stray_bytes]))
    result = await runtime.run(session, "go")
    assert result.final_text == "Done."
    assert session.messages[1].tool_calls[0].arguments == {"text": "caf\ufffd"}
    assert session.messages[2].content == "got caf\ufffd"
    assert "\ufffd" in session.messages[4].content
    assert all(utf8(m.content) and utf8(json.dumps(m.to_openai(), ensure_ascii=False)) for m in session.messages)


async def test_a_callers_tool_result_with_lone_surrogates_is_replaced():
    lookup = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    engine = ScriptedEngine([call("lookup"), "Read it."])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(Agent(name="a", tools=[lookup]))
    first = await runtime.run(session, "look it up")
    pending = first.pending_tool_calls[0]
    await runtime.run(session, [{"role": "tool", "tool_call_id": pending.id, "content": "x\udcff"}])
    assert session.messages[2].content == "x\ufffd"
