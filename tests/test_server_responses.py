"""``/v1/responses`` on the scripted engine and a real SQLite store, in process: responses stored,
chained by ``previous_response_id`` on live KV and across a restart (KV from the snapshot), read and
deleted; tenants, superseded and unknown ids; client- and server-executed tools; the event stream;
and runs that never finish leaving the chain continuable."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agentkv.memory import Store
from agentkv.server import AgentDefaults, create_app
from agentkv.testing import ScriptedEngine
from agentkv.tools import calculator

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'responses.db'}")


def client_for(engine: ScriptedEngine, store: Store | None, *, api_key: str | None = KEY,
               **options) -> httpx.AsyncClient:
    app = create_app(engine, store=store, api_key=api_key, model_id="scripted", **options)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, raise_app_exceptions=False), base_url="http://test",
                             headers=AUTH if api_key else {})


async def respond(client: httpx.AsyncClient, **body) -> dict:
    response = await client.post("/v1/responses", json={"model": "scripted", "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


def text_of(body: dict) -> str:
    return "".join(part["text"] for item in body["output"] if item["type"] == "message" for part in item["content"])


def turn_tokens(engine: ScriptedEngine, text: str) -> int:
    return len(engine.tokenizer.encode(f"<|im_end|>\n<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"))


async def test_a_chained_response_sends_and_prefills_only_its_new_input(store):
    engine = ScriptedEngine(["Hello!", "I am fine."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Hi", instructions="Be brief.")
        assert first["object"] == "response" and first["status"] == "completed" and first["store"] is True
        assert text_of(first) == "Hello!" and first["id"].startswith("resp_")
        second = await respond(client, input="How are you?", instructions="Be brief.",
                               previous_response_id=first["id"])
        assert text_of(second) == "I am fine." and second["previous_response_id"] == first["id"]
        usage = second["usage"]
        prefilled = usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
        assert prefilled <= turn_tokens(engine, "How are you?")
        assert "Hi" in engine.calls[1].prompt_text and "Hello!" in engine.calls[1].prompt_text
        assert (await client.get(f"/v1/responses/{first['id']}")).json() == first
    engine.assert_complete()


async def test_a_chain_continues_after_a_restart_on_the_kv_snapshot(store):
    engine = ScriptedEngine(["Hello!"])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Hi")
    restarted = ScriptedEngine(["Still here."])
    async with client_for(restarted, store) as client:
        assert (await client.get(f"/v1/responses/{first['id']}")).json()["output"] == first["output"]
        second = await respond(client, input="Are you there?", previous_response_id=first["id"])
        assert text_of(second) == "Still here."
        usage = second["usage"]
        assert usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"] <= turn_tokens(
            restarted, "Are you there?")
        prefilled = usage["input_tokens"] - usage["input_tokens_details"]["cached_tokens"]
        assert restarted.calls[0].metrics.prefilled_tokens == prefilled


async def test_unknown_and_other_tenants_responses_are_404_and_an_older_one_is_409(store):
    engine = ScriptedEngine(["One.", "Two."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Count")
        second = await respond(client, input="Again", previous_response_id=first["id"])
        older = await client.post("/v1/responses", json={"model": "m", "input": "Branch?",
                                                         "previous_response_id": first["id"]})
        assert older.status_code == 409 and older.json()["error"]["code"] == "response_superseded"
        assert second["id"] in older.json()["error"]["message"]
        unknown = await client.post("/v1/responses",
                                    json={"model": "m", "input": "x", "previous_response_id": "resp_no"})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "response_not_found"
        other = {"Authorization": "Bearer another-key"}
    async with client_for(ScriptedEngine([]), store, api_key=None) as client:
        assert (await client.get(f"/v1/responses/{second['id']}", headers=other)).status_code == 404
        chained = await client.post("/v1/responses", headers=other, json={
            "model": "m", "input": "x", "previous_response_id": second["id"]})
        assert chained.status_code == 404
    engine.assert_complete()


async def test_deleting_the_last_response_of_a_conversation_deletes_the_conversation(store):
    engine = ScriptedEngine(["One.", "Two."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Count")
        second = await respond(client, input="Again", previous_response_id=first["id"])
        deleted = await client.delete(f"/v1/responses/{first['id']}")
        assert deleted.json() == {"id": first["id"], "object": "response.deleted", "deleted": True}
        assert (await client.get(f"/v1/responses/{first['id']}")).status_code == 404
        assert len(await store.list_conversations()) == 1  # the second response still needs it
        await client.delete(f"/v1/responses/{second['id']}")
        assert await store.list_conversations() == []
        assert (await client.delete(f"/v1/responses/{second['id']}")).status_code == 404


async def test_store_false_is_not_kept_and_leaves_the_stored_conversation_as_it_was(store):
    engine = ScriptedEngine(["Hello!", "A side answer.", "Back on track."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Hi")
        side = await respond(client, input="Aside?", previous_response_id=first["id"], store=False)
        assert text_of(side) == "A side answer." and "Hello!" in engine.calls[1].prompt_text
        assert (await client.get(f"/v1/responses/{side['id']}")).status_code == 404
        main = await respond(client, input="Go on", previous_response_id=first["id"])
        assert "Aside?" not in engine.calls[2].prompt_text and text_of(main) == "Back on track."


async def test_a_client_executed_function_round_trip(store):
    engine = ScriptedEngine([call("get_weather", city="Oslo"), "It is 3 C in Oslo."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Weather in Oslo?", tools=[WEATHER])
        [item] = first["output"]
        assert item["type"] == "function_call" and item["name"] == "get_weather"
        assert json.loads(item["arguments"]) == {"city": "Oslo"}
        second = await respond(client, tools=[WEATHER], previous_response_id=first["id"], input=[
            {"type": "function_call_output", "call_id": item["call_id"], "output": "3 C"}])
        assert text_of(second) == "It is 3 C in Oslo."
        assert engine.calls[1].metrics.prefilled_tokens < 30  # the tool result only
    engine.assert_complete()


async def test_server_tools_run_on_the_server_and_show_as_output_items(store):
    engine = ScriptedEngine([call("calculator", expression="6*7"), "It is 42."])
    async with client_for(engine, store, defaults=AgentDefaults(tools=(calculator,))) as client:
        body = await respond(client, input="What is 6*7?")
        kinds = [item["type"] for item in body["output"]]
        assert kinds == ["function_call", "function_call_output", "message"]
        assert body["output"][1]["output"] == "42" and text_of(body) == "It is 42."


async def test_the_stream_announces_items_in_order_and_ends_with_the_stored_response(store):
    engine = ScriptedEngine(["Hello there, friend!"])
    async with client_for(engine, store) as client:
        request = {"model": "m", "input": "Hi", "stream": True}
        async with client.stream("POST", "/v1/responses", json=request) as response:
            assert response.status_code == 200
            events = [json.loads(line[5:]) for line in [x async for x in response.aiter_lines()]
                      if line.startswith("data:")]
        kinds = [e["type"] for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.completed"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        final = events[-1]["response"]
        assert deltas == text_of(final) == "Hello there, friend!"
        assert events[2]["item"]["id"] == final["output"][0]["id"]
        assert (await client.get(f"/v1/responses/{final['id']}")).json() == final


async def test_refused_input_is_an_http_error_even_when_streaming_and_stores_nothing(store):
    engine = ScriptedEngine(["Hello!"])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Hi")
        stray = {"model": "m", "stream": True, "previous_response_id": first["id"],
                 "input": [{"type": "function_call_output", "call_id": "call_none", "output": "x"}]}
        response = await client.post("/v1/responses", json=stray)
        assert response.status_code == 400 and "call_none" in response.json()["error"]["message"]
        for bad, fragment in (({"tools": [{"type": "web_search"}]}, "function tools"),
                              ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text only"),
                              ({"conversation": "conv_1"}, "previous_response_id"),
                              ({"text": {"format": {"type": "yaml"}}}, "text.format")):
            answer = await client.post("/v1/responses", json={"model": "m", "input": "x", **bad})
            assert answer.status_code == 400 and fragment in answer.json()["error"]["message"], answer.text
        assert len(await store.list_conversations()) == 1


async def test_a_run_that_fails_leaves_no_response_and_the_chain_continues_without_its_input(store):
    engine = ScriptedEngine(["Hello!", RuntimeError("the model crashed"), "Welcome back."])
    async with client_for(engine, store) as client:
        first = await respond(client, input="Hi")
        failed = await client.post("/v1/responses", json={"model": "m", "input": "Lost words",
                                                          "previous_response_id": first["id"]})
        assert failed.status_code == 500
        again = await respond(client, input="Retry", previous_response_id=first["id"])
        assert text_of(again) == "Welcome back." and "Lost words" not in engine.calls[2].prompt_text
        new_failed = ScriptedEngine([RuntimeError("crash on the first turn")])
    async with client_for(new_failed, store) as client:
        assert (await client.post("/v1/responses", json={"model": "m", "input": "Hi"})).status_code == 500
    assert len(await store.list_conversations()) == 1  # the failed first turn left no conversation


async def test_without_a_store_only_store_false_is_served():
    engine = ScriptedEngine(["Hello!"])
    async with client_for(engine, None) as client:
        refused = await client.post("/v1/responses", json={"model": "m", "input": "Hi"})
        assert refused.status_code == 400 and "store=false" in refused.json()["error"]["message"]
        body = await respond(client, input="Hi", store=False)
        assert text_of(body) == "Hello!"
