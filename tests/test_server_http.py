"""The server's HTTP edge on the scripted engine, in process: every error is an OpenAI error
object (unknown routes, wrong methods, bodies that are not UTF-8 JSON, empty bodies), the key is
checked before the body is read, the answer's reserve is what the request asks for, and each
request leaves one access log line (log-probabilities: ``test_server_logprobs.py``)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import httpx

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


def client_for(engine: ScriptedEngine, *, store: Store | None = None) -> httpx.AsyncClient:
    app = create_app(engine, store=store, api_key=KEY, model_id="scripted")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", headers=AUTH)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"] and body["error"]["type"]
    return body["error"]


async def test_routes_methods_and_unreadable_bodies_answer_openai_error_objects():
    async with client_for(ScriptedEngine([])) as client:
        assert "no route" in assert_openai_error(await client.get("/v1/nothing"), 404)["message"]
        assert_openai_error(await client.get("/v1/chat/completions"), 405)
        not_utf8 = await client.post("/v1/chat/completions", content=b'{"model": "\xff\xfe"}',
                                     headers={"Content-Type": "application/json"})
        assert "UTF-8" in assert_openai_error(not_utf8, 400)["message"]
        malformed = await client.post("/v1/chat/completions", content=b'{"model": "m", "messages": [}',
                                      headers={"Content-Type": "application/json"})
        error = assert_openai_error(malformed, 400)
        assert "not valid JSON" in error["message"] and error["param"] is None
        empty = await client.post("/v1/responses", content=b"", headers={"Content-Type": "application/json"})
        error = assert_openai_error(empty, 400)
        assert "empty" in error["message"] and error["param"] is None
        a_list = await client.post("/v1/responses", content=b"[]", headers={"Content-Type": "application/json"})
        error = assert_openai_error(a_list, 400)
        assert "not a JSON object" in error["message"] and error["param"] is None


async def test_the_key_is_checked_before_the_body_is_read():
    async with client_for(ScriptedEngine([])) as client:
        for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
            malformed = await client.post("/v1/chat/completions", content=b"{not json",
                                          headers={**headers, "Content-Type": "application/json"})
            assert assert_openai_error(malformed, 401)["code"] == "invalid_api_key"
            assert_openai_error(await client.get("/v1/nothing", headers=headers), 401)


def long_words(engine: ScriptedEngine, tokens: int) -> str:
    """A user message of about ``tokens`` tokens."""
    text = "word " * tokens
    assert abs(len(engine.tokenizer.encode(text)) - tokens) <= 2
    return text


async def test_the_context_check_reserves_the_answer_length_the_request_asks_for(tmp_path: Path):
    engine = ScriptedEngine(["Fine.", "Fine."], max_context_len=512)
    text = long_words(engine, 400)  # leaves < 256 (the default reserve) but > 8 tokens of the context
    async with client_for(engine, store=Store(f"sqlite:///{tmp_path / 'r.db'}")) as client:
        chat = {"model": "m", "messages": [{"role": "user", "content": text}]}
        refused = assert_openai_error(await client.post("/v1/chat/completions", json=chat), 413)
        assert "--policy truncation|sliding|summarize" in refused["message"]  # says how to make it fit
        assert_openai_error(await client.post("/v1/chat/completions", json={**chat, "max_tokens": 200}), 413)
        short = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 8})
        assert short.status_code == 200 and short.json()["choices"][0]["message"]["content"] == "Fine."
        response = {"model": "m", "input": text}
        assert assert_openai_error(await client.post("/v1/responses", json=response), 413)["param"] == "input"
        short = await client.post("/v1/responses", json={**response, "max_output_tokens": 8})
        assert short.status_code == 200, short.text
        too_long = await client.post("/v1/chat/completions", json={**chat, "max_tokens": 512})
        assert assert_openai_error(too_long, 400)["param"] == "max_tokens"
        too_long = await client.post("/v1/responses", json={**response, "max_output_tokens": 512})
        assert assert_openai_error(too_long, 400)["param"] == "max_output_tokens"
    engine.assert_complete()


async def test_input_errors_of_the_responses_api_name_input_as_their_param():
    async with client_for(ScriptedEngine([])) as client:
        stray = [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]
        for bad_input in (stray, [{"role": "critic", "content": "x"}]):
            answer = await client.post("/v1/responses", json={"model": "m", "input": bad_input, "store": False})
            assert assert_openai_error(answer, 400)["param"] == "input"


async def test_each_request_leaves_one_access_log_line(caplog):
    engine = ScriptedEngine(["Hello!", "Hello again!", "Streamed."])
    caplog.set_level(logging.INFO, logger="agentkv.server.access")
    async with client_for(engine) as client:
        messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
        first = (await client.post("/v1/chat/completions", json={"model": "m", "messages": messages},
                                   headers={"X-Session-Id": "s1"})).json()
        messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Again"}]
        second = (await client.post("/v1/chat/completions", json={"model": "m", "messages": messages},
                                    headers={"X-Session-Id": "s1"})).json()
        async with client.stream("POST", "/v1/responses", json={"model": "m", "input": "Go", "store": False,
                                                                "stream": True}) as streamed:
            events = [json.loads(line[5:]) async for line in streamed.aiter_lines() if line.startswith("data:")]
        await client.get("/v1/models", headers={"Authorization": "Bearer wrong"})
    lines = [r.getMessage() for r in caplog.records if r.name == "agentkv.server.access"]
    pattern = re.compile(r"^(GET|POST) (\S+) (\d{3}) (\d+\.\d)ms id=(\S+) conversation=(\S+) cached_tokens=(\S+)$")
    parsed = [pattern.match(line) for line in lines]
    assert len(lines) == 4 and all(parsed), lines
    assert [(m[1], m[2], m[3]) for m in parsed] == [  # type: ignore[index]
        ("POST", "/v1/chat/completions", "200"), ("POST", "/v1/chat/completions", "200"),
        ("POST", "/v1/responses", "200"), ("GET", "/v1/models", "401")]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and parsed[1][7] == str(cached) and parsed[1][6] == "s1" and parsed[1][5] == second["id"]
    assert parsed[0][5] == first["id"] and parsed[2][5] == events[-1]["response"]["id"]
    assert parsed[3].groups()[4:] == ("-", "-", "-")


async def test_an_unexpected_failure_is_logged_as_the_500_it_answers(caplog):
    def boom(call):
        raise RuntimeError("the engine broke")

    caplog.set_level(logging.INFO, logger="agentkv.server.access")
    app = create_app(ScriptedEngine([boom]), api_key=KEY, model_id="scripted")
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as client:
        answer = await client.post("/v1/chat/completions",
                                   json={"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert answer.status_code == 500
    [line] = [r.getMessage() for r in caplog.records if r.name == "agentkv.server.access"]
    assert line.startswith("POST /v1/chat/completions 500 ")
