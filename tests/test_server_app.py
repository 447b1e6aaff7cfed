"""The server app on the scripted engine, in process (httpx's ASGI transport): routes, auth, the
OpenAI error statuses, KV reuse across stateless requests, and streaming — no model needed."""

from __future__ import annotations

import json

import anyio
import httpx
import pytest

from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def client_for(engine: ScriptedEngine, **options) -> httpx.AsyncClient:
    app = create_app(engine, api_key=KEY, model_id="scripted", **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=AUTH)


def body(messages, **extra):
    return {"model": "scripted", "messages": messages, "temperature": 0, **extra}


async def test_requests_without_the_key_get_401_and_health_needs_none():
    async with client_for(ScriptedEngine([])) as client:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            response = await client.get("/v1/models", headers=headers)
            assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        assert (await client.get("/health", headers={"Authorization": ""})).status_code == 200
        models = (await client.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["scripted"]


async def test_a_resent_history_reuses_the_kv_and_reports_it_as_cached_tokens():
    engine = ScriptedEngine(["Hello!", "Fine, thanks.", "Bye."])
    async with client_for(engine) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        cached = []
        for reply, question in (("Hello!", "How are you?"), ("Fine, thanks.", "Goodbye")):
            answer = (await client.post("/v1/chat/completions", json=body(messages))).json()
            assert answer["choices"][0]["message"]["content"] == reply
            assert answer["choices"][0]["finish_reason"] == "stop"
            cached.append(answer["usage"]["prompt_tokens_details"]["cached_tokens"])
            messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": question}]
        last = (await client.post("/v1/chat/completions", json=body(messages))).json()
        usage = last["usage"]
        new_turn = len(engine.tokenizer.encode(
            "<|im_end|>\n<|im_start|>user\nGoodbye<|im_end|>\n<|im_start|>assistant\n"))
        assert usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"] <= new_turn
        assert cached[0] == 0 and cached[1] > 0
    engine.assert_complete()


async def test_without_kv_reuse_every_request_prefills_everything():
    engine = ScriptedEngine(["One.", "Two."])
    async with client_for(engine, reuse_kv=False) as client:
        messages = [{"role": "user", "content": "Count"}]
        await client.post("/v1/chat/completions", json=body(messages))
        messages += [{"role": "assistant", "content": "One."}, {"role": "user", "content": "Again"}]
        usage = (await client.post("/v1/chat/completions", json=body(messages))).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0


async def test_a_client_executed_tool_round_trip_and_its_stream_carry_the_calls():
    engine = ScriptedEngine([call("get_weather", city="Oslo"), "It is 3 C.", call("get_weather", city="Rome")])
    async with client_for(engine) as client:
        messages = [{"role": "user", "content": "Weather in Oslo?"}]
        first = (await client.post("/v1/chat/completions", json=body(messages, tools=[WEATHER]))).json()
        choice = first["choices"][0]
        assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
        [tool_call] = choice["message"]["tool_calls"]
        assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
        messages += [choice["message"], {"role": "tool", "tool_call_id": tool_call["id"], "content": "3 C"}]
        second = (await client.post("/v1/chat/completions", json=body(messages, tools=[WEATHER]))).json()
        assert second["choices"][0]["message"]["content"] == "It is 3 C."
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"]
        chunks = []
        async with client.stream("POST", "/v1/chat/completions", json=body(
                [{"role": "user", "content": "Rome?"}], tools=[WEATHER], stream=True,
                stream_options={"include_usage": True})) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[0]["choices"][0]["delta"]["role"] == "assistant"
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in parsed
             if c["choices"] and "tool_calls" in c["choices"][0]["delta"]]
    assert calls == [[{"index": 0, "id": calls[0][0]["id"], "type": "function",
                       "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]]
    assert [c["choices"][0]["finish_reason"] for c in parsed if c["choices"]][-1] == "tool_calls"
    assert parsed[-1]["choices"] == [] and parsed[-1]["usage"]["completion_tokens"] > 0


@pytest.mark.parametrize("payload, status, fragment", [
    ({"messages": [{"role": "user", "content": "hi"}]}, 400, "model"),
    ({"model": "m", "messages": []}, 400, "messages"),
    ({"model": "m", "messages": [{"role": "critic", "content": "x"}]}, 400, "message 0"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     400, "last message"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n=1"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, 400,
     "at least one tool"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tool"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400, "schema"),
    ({"model": "m", "messages": [{"role": "user", "content": "word " * 300}]}, 413, "tokens"),
    ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 5}, 400, "temperature"),
])
async def test_bad_requests_get_openai_errors_with_the_right_status(payload, status, fragment):
    async with client_for(ScriptedEngine([], max_context_len=512)) as client:
        response = await client.post("/v1/chat/completions", json=payload)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert fragment in error["message"] and error["type"]


async def while_one_request_runs(client, then, *, pin: str | None = None):
    """Run ``then()`` while a slow request (pinned to ``pin``) is generating; both results."""
    results = {}

    async def slow() -> None:
        headers = {"X-Session-Id": pin} if pin else {}
        results["slow"] = await client.post("/v1/chat/completions", json=body([{"role": "user", "content": "go"}]),
                                            headers=headers)

    async with anyio.create_task_group() as tg:
        tg.start_soon(slow)
        await anyio.sleep(0.2)
        results["then"] = await then()
    return results["slow"], results["then"]


async def test_a_request_pinned_to_a_session_that_is_running_gets_409_and_loses_nothing():
    engine = ScriptedEngine(["a long answer " * 5, "second"], decode_s_per_token=0.02)
    async with client_for(engine) as client:
        slow, busy = await while_one_request_runs(client, lambda: client.post(
            "/v1/chat/completions", json=body([{"role": "user", "content": "hi"}]), headers={"X-Session-Id": "pinned"}),
            pin="pinned")
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"
        assert slow.status_code == 200
        again = await client.post("/v1/chat/completions", json=body([{"role": "user", "content": "hi"}]),
                                  headers={"X-Session-Id": "pinned"})
        assert again.status_code == 200 and again.json()["choices"][0]["message"]["content"] == "second"


async def test_a_server_running_its_limit_of_requests_answers_429():
    engine = ScriptedEngine(["a long answer " * 5, "second"], decode_s_per_token=0.02)
    async with client_for(engine, max_running=1) as client:
        slow, full = await while_one_request_runs(client, lambda: client.post(
            "/v1/chat/completions", json=body([{"role": "user", "content": "hi"}])))
        assert full.status_code == 429 and full.json()["error"]["code"] == "rate_limit_exceeded"
        assert slow.status_code == 200
        again = await client.post("/v1/chat/completions", json=body([{"role": "user", "content": "hi"}]))
        assert again.status_code == 200


async def test_response_format_makes_the_content_json_under_the_schema():
    engine = ScriptedEngine(['{"city": "Paris"}'])
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    async with client_for(engine) as client:
        answer = (await client.post("/v1/chat/completions", json=body(
            [{"role": "user", "content": "A city?"}],
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}))).json()
    assert json.loads(answer["choices"][0]["message"]["content"]) == {"city": "Paris"}
    assert "answer: %json" in engine.requested_grammars[0]


async def test_two_tenants_with_the_same_system_prompt_never_share_kv():
    engine = ScriptedEngine(["A1", "A2", "B1"], prefix_cache_bytes=None)
    system = {"role": "system", "content": "You are the archive's assistant. " * 20}
    async with client_for(engine) as client:
        async def cached(salt: str, question: str) -> int:
            answer = (await client.post("/v1/chat/completions", json=body(
                [system, {"role": "user", "content": question}], cache_salt=salt))).json()
            return answer["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert await cached("tenant-a", "First question?") == 0
        assert await cached("tenant-a", "Another question entirely?") > 100  # its own system prompt's KV
        assert await cached("tenant-b", "First question?") == 0  # the same prompt, another tenant


async def test_a_completion_says_where_and_why_its_prompt_left_the_kv():
    engine = ScriptedEngine(["Hello!", "Again."])
    async with client_for(engine) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
        first = (await client.post("/v1/chat/completions", json=body(messages, user="pinned"))).json()
        assert first["agentkv"] == {"cache_break": None}
        # the client edited its earlier turn: the pinned session holds the old one
        edited = [messages[0], {"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "More"}]
        answer = (await client.post("/v1/chat/completions", json=body(edited, user="pinned"))).json()
        found = answer["agentkv"]["cache_break"]
        assert (found["message_index"], found["role"], found["part"]) == (1, "user", "content")
        assert "Hi" in found["kv_excerpt"] and "Hello" in found["prompt_excerpt"] and "cause" in found["summary"]
