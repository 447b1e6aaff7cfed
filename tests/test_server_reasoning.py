"""A reasoning model's thinking as the ``openai`` client sees it from ``agentkv serve`` (in process):
``reasoning_content`` in chat completions (streamed: ``delta.reasoning_content``), a ``reasoning``
output item in the Responses API; never in ``content``, output text or a call's arguments.

The scripted tokenizer's template is given the tags (``<think>`` / ``</think>`` in its source, as
Qwen3's template has them), so the server's renderers detect a reasoning model.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.server.response_wire import ResponseRequest
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.testing import ScriptedEngine
from agentkv.testing.tokenizer import CHAT_TEMPLATE, ScriptedTokenizer

KEY = "sk-test"
PLAN = "first add, then check"
THINKING = f"<think>\n{PLAN}\n</think>\n\n"
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(autouse=True)
def reasoning_template(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ScriptedTokenizer, "chat_template",
                        property(lambda self: CHAT_TEMPLATE + "{#- a reasoning model: <think> … </think> #}"))


def client_for(engine: ScriptedEngine, tmp_path) -> openai.AsyncOpenAI:
    app = create_app(engine, store=Store(f"sqlite:///{tmp_path / 'r.db'}"), api_key=KEY, model_id="m")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(api_key=KEY, base_url="http://test/v1", http_client=http, max_retries=0)


async def test_a_chat_completion_returns_the_thinking_as_reasoning_content(tmp_path):
    engine = ScriptedEngine([THINKING + "The answer."])
    async with client_for(engine, tmp_path) as client:
        completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q?"}])
    message = completion.choices[0].message
    assert (message.content, message.reasoning_content) == ("The answer.", PLAN)  # type: ignore[attr-defined]


async def test_a_streamed_chat_completion_sends_the_thinking_as_reasoning_deltas(tmp_path):
    engine = ScriptedEngine([THINKING + "The answer."])
    async with client_for(engine, tmp_path) as client:
        stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Q?"}],
                                                      stream=True)
        deltas = [chunk.choices[0].delta async for chunk in stream if chunk.choices]
    thoughts = [d.reasoning_content for d in deltas if getattr(d, "reasoning_content", None)]  # type: ignore[attr-defined]
    assert "".join(thoughts) == PLAN and len(thoughts) > 1
    assert "".join(d.content or "" for d in deltas) == "The answer."


async def test_thinking_before_a_tool_call_is_reasoning_content_not_arguments(tmp_path):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    engine = ScriptedEngine([THINKING + call])
    async with client_for(engine, tmp_path) as client:
        completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3?"}],
                                                          tools=[ADD])  # type: ignore[list-item]
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.reasoning_content == PLAN  # type: ignore[attr-defined]
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls or []] == [{"a": 2, "b": 3}]
    assert engine.requested_grammars[0].startswith("start: reasoning? answer_after_reasoning\n")


def test_an_assistant_message_sent_with_reasoning_content_keeps_it():
    messages = messages_from_openai([{"role": "user", "content": "Q?"},
                                       {"role": "assistant", "content": "A.", "reasoning_content": "plan"},
                                       {"role": "user", "content": "And?"}])
    assert [(m.role, m.content, m.reasoning) for m in messages] == [
        ("user", "Q?", None), ("assistant", "A.", "plan"), ("user", "And?", None)]


async def test_a_response_has_a_reasoning_item_before_its_message(tmp_path):
    engine = ScriptedEngine([THINKING + "The answer."])
    async with client_for(engine, tmp_path) as client:
        response = await client.responses.create(model="m", input="Q?")
    thinking, message = response.output
    assert thinking.type == "reasoning" and [c.text for c in thinking.content or []] == [PLAN]  # type: ignore[union-attr]
    assert thinking.summary == []  # type: ignore[union-attr]
    assert message.type == "message" and response.output_text == "The answer."


async def test_a_streamed_response_sends_reasoning_text_events_then_the_answer(tmp_path):
    engine = ScriptedEngine([THINKING + "The answer."])
    async with client_for(engine, tmp_path) as client:
        stream = await client.responses.create(model="m", input="Q?", stream=True)
        events = [event async for event in stream]
    kinds = [event.type for event in events]
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]  # type: ignore[union-attr]
    assert "".join(deltas) == PLAN
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert text == "The answer."
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["reasoning", "message"]


def test_a_reasoning_input_item_becomes_the_next_assistant_turns_reasoning():
    request = ResponseRequest.model_validate({"model": "m", "input": [
        {"role": "user", "content": "Q?"},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "plan"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "A."}]},
        {"role": "user", "content": "And?"}]})
    messages = messages_from_openai(request.input_messages())
    assert [(m.role, m.content, m.reasoning) for m in messages] == [
        ("user", "Q?", None), ("assistant", "A.", "plan"), ("user", "And?", None)]
