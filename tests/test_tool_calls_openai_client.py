"""Tool calls as the ``openai`` client sees them from ``agentkv serve`` (in process): raw-schema
tools get a grammar without invented keys, a parallel call cut by ``max_tokens`` is retried or
reported (never markup in ``content``, never a trailing message item), and identical calls in one
step come back once. The scripted engine replays the model; one test runs the issue's repro on the
real model (marked ``model``)."""

from __future__ import annotations

import json

import httpx
import openai

from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import format_tool_calls
from agentkv.engine.decode.constraints import ConstraintFactory
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.tokenizer import OVTokenizer
from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
DISTANCE = {"name": "geo.distance", "description": "Distance in km between two cities.",
            "parameters": {"type": "object", "properties": {"start": {"type": "string"}, "end": {"type": "string"}},
                           "required": ["start", "end"]}}
QUESTION = "Distance from Boston to Paris, and from Rome to Oslo?"


def call(start: str, end: str) -> str:
    return format_tool_calls([ToolCall(name="geo.distance", arguments={"start": start, "end": end})])


TWO_CALLS = call("Boston", "Paris") + "\n" + call("Rome", "Oslo")


def client_for(engine, tmp_path) -> openai.AsyncOpenAI:
    app = create_app(engine, store=Store(f"sqlite:///{tmp_path / 'r.db'}"), api_key=KEY, model_id="m")
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test")
    return openai.AsyncOpenAI(api_key=KEY, base_url="http://test/v1", http_client=http, max_retries=0)


def cut_tokens(engine: ScriptedEngine, reply: str) -> int:
    """Tokens that cut ``reply`` just after the "\\n<" opening its second block."""
    ids = engine.tokenizer.encode(reply)
    return next(n for n in range(1, len(ids)) if engine.tokenizer.decode(ids[:n]).endswith(">\n<"))


async def chat(client: openai.AsyncOpenAI, max_tokens: int):
    return await client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=max_tokens,
        tools=[{"type": "function", "function": DISTANCE}], tool_choice="required")


async def respond(client: openai.AsyncOpenAI, max_tokens: int):
    return await client.responses.create(model="m", input=QUESTION, temperature=0, max_output_tokens=max_tokens,
                                         tools=[{"type": "function", **DISTANCE}], tool_choice="required")


def arguments(calls) -> list[dict]:
    return [json.loads(c.function.arguments if hasattr(c, "function") else c.arguments) for c in calls]


async def test_a_raw_schema_tool_from_the_client_gets_a_grammar_without_invented_keys(tmp_path):
    engine = ScriptedEngine([call("Boston", "Paris")])
    async with client_for(engine, tmp_path) as client:
        await chat(client, 64)
    meta, model = resolve_model(None).gguf_metadata(), resolve_model(None)
    tokenizer = OVTokenizer(model.ir_dir)
    factory = ConstraintFactory(meta["tokenizer.ggml.tokens"], eos_token_id=2, vocab_size=49152,
                                token_types=meta["tokenizer.ggml.token_type"], encode=tokenizer.encode)

    def accepted(args: dict) -> bool:
        constraint = factory(engine.requested_grammars[0])
        for token in tokenizer.encode(format_tool_calls([ToolCall(name="geo.distance", arguments=args)])) + [2]:
            if not constraint.allowed_mask()[token]:
                return False
            constraint.advance(token)
        return True

    assert accepted({"start": "Boston", "end": "Paris"})
    assert not accepted({"start": "Boston", "end": "Paris", "type": "string"})
    assert not accepted({"start": "Boston", "end": "Paris", "description": "Distance"})


async def test_a_parallel_call_cut_by_max_tokens_is_retried_for_chat_and_responses(tmp_path):
    engine = ScriptedEngine([TWO_CALLS] * 4)
    limit = cut_tokens(engine, TWO_CALLS)
    async with client_for(engine, tmp_path) as client:
        completion = await chat(client, limit)
        response = await respond(client, limit)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert arguments(choice.message.tool_calls) == [{"start": "Boston", "end": "Paris"},
                                                    {"start": "Rome", "end": "Oslo"}]
    assert [item.type for item in response.output] == ["function_call", "function_call"]
    assert arguments(response.output) == arguments(choice.message.tool_calls)
    engine.assert_complete()


async def test_a_parallel_call_still_cut_is_reported_as_cut_with_no_markup_for_chat_and_responses(tmp_path):
    # NOTE: a retry gets all the room the window leaves: the second call outgrows it
    long_second = call("Boston", "Paris") + "\n" + call("Rome", "O" * 12000)
    engine = ScriptedEngine([long_second] * 4, max_context_len=1024)
    limit = cut_tokens(engine, long_second)
    async with client_for(engine, tmp_path) as client:
        completion = await chat(client, limit)
        response = await respond(client, limit)
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and not choice.message.content and not choice.message.tool_calls
    assert response.status == "incomplete" and response.output_text == ""
    assert all(item.type != "message" for item in response.output)
    engine.assert_complete()


async def test_identical_calls_in_one_step_reach_the_client_once(tmp_path):
    engine = ScriptedEngine(["\n".join([call("Boston", "Paris")] * 3 + [call("Rome", "Oslo")])] * 2)
    async with client_for(engine, tmp_path) as client:
        completion = await chat(client, 256)
        response = await respond(client, 256)
    assert arguments(completion.choices[0].message.tool_calls) == [
        {"start": "Boston", "end": "Paris"}, {"start": "Rome", "end": "Oslo"}]
    assert arguments(response.output) == arguments(completion.choices[0].message.tool_calls)


