"""The routing surface a session-affine proxy needs, on the scripted engine in process: the
``X-Session-Id`` header accepted, checked and echoed on both APIs (streams too) and derived when
missing, ``GET /ready`` (starting, ready, draining), ``GET /v1/conversations/{id}/locality`` (live,
snapshot, none, unknown) and the snapshot counters on ``/metrics``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import openai
import pytest
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from agentkv.errors import StoreUnavailable
from agentkv.memory import Store
from agentkv.observe.metrics import CACHED_PROMPT_TOKENS, SNAPSHOT_RESTORES, SNAPSHOT_SAVES
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER = "X-Session-Id"


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(f"sqlite:///{tmp_path / 'routing.db'}")


@asynccontextmanager
async def serving(engine: ScriptedEngine, store: Store | None = None, *,
                  api_key: str | None = KEY) -> AsyncIterator[tuple[FastAPI, httpx.AsyncClient]]:
    """The app, started (its lifespan runs, as under uvicorn), and an httpx client on it."""
    app = create_app(engine, store=store, api_key=api_key, model_id="scripted")
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH if api_key else {}) as client:
            yield app, client


def chat(messages: list[dict], **extra) -> dict:
    return {"model": "scripted", "messages": messages, "temperature": 0, **extra}


def openai_on(client: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=KEY, base_url="http://test/v1", http_client=client, max_retries=0)


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics", headers={"Authorization": ""})).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


# ---- X-Session-Id on chat completions --------------------------------------------------------
async def test_a_chat_completion_echoes_the_named_session_and_continues_its_kv():
    engine = ScriptedEngine(["Hello!", "Fine."])
    async with serving(engine) as (_, client):
        client_ = openai_on(client)
        messages = [{"role": "user", "content": "Hi"}]
        raw = await client_.chat.completions.with_raw_response.create(
            model="scripted", messages=messages, extra_headers={HEADER: "conv-1"})
        assert raw.headers[HEADER] == "conv-1" and raw.parse().choices[0].message.content == "Hello!"
        messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "How are you?"}]
        again = await client.post("/v1/chat/completions", json=chat(messages), headers={HEADER: "conv-1"})
        assert again.headers[HEADER] == "conv-1"
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    engine.assert_complete()


async def test_without_the_header_a_chat_completion_gets_the_id_of_the_session_it_continues():
    engine = ScriptedEngine(["Hello!", "Fine.", "Other."])
    async with serving(engine) as (_, client):
        messages = [{"role": "user", "content": "Hi"}]
        first = await client.post("/v1/chat/completions", json=chat(messages))
        conversation_id = first.headers[HEADER]
        assert conversation_id.startswith("sess_")
        messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And you?"}]
        second = await client.post("/v1/chat/completions", json=chat(messages))
        assert second.headers[HEADER] == conversation_id  # the live session its history continues
        other = await client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "Unrelated"}]))
        assert other.headers[HEADER] not in (conversation_id, "")
    engine.assert_complete()


async def test_a_streamed_chat_completion_carries_the_header():
    engine = ScriptedEngine(["Streamed answer."])
    async with serving(engine) as (_, client):
        client_ = openai_on(client)
        async with client_.chat.completions.with_streaming_response.create(
                model="scripted", messages=[{"role": "user", "content": "Hi"}], stream=True,
                extra_headers={HEADER: "conv-stream"}) as raw:
            assert raw.headers[HEADER] == "conv-stream"
            text = "".join([c.choices[0].delta.content or "" async for c in await raw.parse() if c.choices])
        assert text == "Streamed answer."


@pytest.mark.parametrize("bad", ["", "x" * 129, "has space", "../etc", "-leading", "naïve"])
async def test_a_bad_session_header_is_a_400_saying_what_an_id_looks_like(bad):
    async with serving(ScriptedEngine([])) as (_, client):
        for path, payload in (("/v1/chat/completions", chat([{"role": "user", "content": "Hi"}])),
                              ("/v1/responses", {"model": "scripted", "input": "Hi", "store": False})):
            response = await client.post(path, json=payload, headers={HEADER: bad.encode("utf-8")})
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["code"] == "invalid_conversation_id" and "letters, digits" in error["message"]


# ---- X-Session-Id on responses ---------------------------------------------------------------
async def test_a_response_chain_carries_its_conversation_id_derived_from_previous_response_id(store):
    engine = ScriptedEngine(["Hello!", "Fine.", "Streamed."])
    async with serving(engine, store) as (_, client):
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"})
        conversation = first.headers[HEADER]
        assert conversation.startswith("sess_") and await store.get_conversation(conversation)
        second = await client.post("/v1/responses", json={"model": "scripted", "input": "How are you?",
                                                          "previous_response_id": first.json()["id"]})
        assert second.status_code == 200 and second.headers[HEADER] == conversation
        client_ = openai_on(client)
        async with client_.responses.with_streaming_response.create(
                model="scripted", input="More?", previous_response_id=second.json()["id"], stream=True) as raw:
            assert raw.headers[HEADER] == conversation
            kinds = [event.type async for event in await raw.parse()]
        assert kinds[-1] == "response.completed"
    engine.assert_complete()


async def test_the_header_names_a_new_conversation_and_then_continues_it_without_response_ids(store):
    engine = ScriptedEngine(["Hello!", "I remember."])
    async with serving(engine, store) as (_, client):
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"},
                                  headers={HEADER: "conv-9"})
        assert first.headers[HEADER] == "conv-9" and (await store.get_conversation("conv-9")).id == "conv-9"
        second = await client.post("/v1/responses", json={"model": "scripted", "input": "Do you remember?"},
                                   headers={HEADER: "conv-9"})
        assert second.status_code == 200 and second.headers[HEADER] == "conv-9"
        assert second.json()["previous_response_id"] == first.json()["id"]
        assert "Hello!" in engine.calls[1].prompt_text
        assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
    engine.assert_complete()


async def test_a_store_false_response_echoes_the_conversation_it_continues_or_its_live_session(store):
    engine = ScriptedEngine(["Hello!", "Aside.", "Alone."])
    async with serving(engine, store) as (_, client):
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"})
        side = await client.post("/v1/responses", json={"model": "scripted", "input": "Aside?", "store": False,
                                                        "previous_response_id": first.json()["id"]})
        assert side.status_code == 200 and side.headers[HEADER] == first.headers[HEADER]
        alone = await client.post("/v1/responses", json={"model": "scripted", "input": "Solo", "store": False})
        assert alone.headers[HEADER].startswith("sess_") and alone.headers[HEADER] != first.headers[HEADER]
    engine.assert_complete()


async def test_a_named_chat_session_running_another_request_answers_409():
    engine = ScriptedEngine(["a slow answer " * 5, "x"], decode_s_per_token=0.02)
    async with serving(engine) as (_, client):
        async def slow() -> None:
            response = await client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "Hi"}]),
                                         headers={HEADER: "conv-busy"})
            assert response.status_code == 200

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await anyio.sleep(0.1)
            busy = await client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "Hi"}]),
                                     headers={HEADER: "conv-busy"})
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy"


async def test_a_header_naming_another_conversation_than_previous_response_id_is_a_400(store):
    engine = ScriptedEngine(["Hello!"])
    async with serving(engine, store) as (_, client):
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"})
        mismatch = await client.post("/v1/responses", headers={HEADER: "conv-other"}, json={
            "model": "scripted", "input": "Again", "previous_response_id": first.json()["id"]})
        assert mismatch.status_code == 400 and mismatch.json()["error"]["code"] == "conversation_mismatch"
        assert first.headers[HEADER] in mismatch.json()["error"]["message"]
    engine.assert_complete()


async def test_another_tenants_conversation_cannot_be_continued_by_naming_it(store):
    engine = ScriptedEngine(["Hello!"])
    async with serving(engine, store) as (_, client):
        await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"}, headers={HEADER: "conv-a"})
    async with serving(ScriptedEngine([]), store, api_key=None) as (_, client):
        taken = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"},
                                  headers={HEADER: "conv-a", "Authorization": "Bearer other"})
        assert taken.status_code == 409 and taken.json()["error"]["code"] == "conversation_conflict"
        assert (await client.get("/v1/conversations/conv-a/locality",
                                 headers={"Authorization": "Bearer other"})).status_code == 404


# ---- /ready ----------------------------------------------------------------------------------
async def test_ready_is_503_before_start_200_once_started_and_503_while_draining(store):
    app = create_app(ScriptedEngine([]), store=store, api_key=KEY)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        starting = await client.get("/ready")  # no key needed: probes carry none
        assert starting.status_code == 503 and starting.json()["reason"].startswith("starting")
        async with app.router.lifespan_context(app):
            ready = await client.get("/ready")
            assert ready.status_code == 200 and ready.json() == {"status": "ready", "reason": "ready"}
            app.state.readiness.drain("a test drains it")
            draining = await client.get("/ready")
            assert draining.status_code == 503 and draining.json()["reason"] == "draining: a test drains it"
            assert (await client.get("/health")).status_code == 200  # alive all the same
        after = await client.get("/ready")
        assert after.status_code == 503 and after.json()["reason"].startswith("draining")


async def test_ready_is_503_when_the_store_cannot_be_reached(store, monkeypatch):
    async def unreachable(conversation_id: str) -> None:  # what a store whose database went away raises
        raise StoreUnavailable(store.database.url, ConnectionRefusedError("connection refused"))

    async with serving(ScriptedEngine([]), store) as (_, client):
        assert (await client.get("/ready")).status_code == 200
        monkeypatch.setattr(store, "get_conversation", unreachable)
        response = await client.get("/ready")
    assert response.status_code == 503 and "store cannot be reached" in response.json()["reason"]


# ---- /v1/conversations/{id}/locality --------------------------------------------------------------
async def test_locality_says_live_here_for_a_chat_session_and_404_for_an_unknown_one():
    engine = ScriptedEngine(["Hello!"])
    async with serving(engine) as (_, client):
        await client.post("/v1/chat/completions", json=chat([{"role": "user", "content": "Hi"}]),
                          headers={HEADER: "conv-live"})
        live = (await client.get("/v1/conversations/conv-live/locality")).json()
        assert live["conversation_id"] == "conv-live" and live["locality"] == "live" and live["tokens"] > 0
        unknown = await client.get("/v1/conversations/conv-none/locality")
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "conversation_not_found"
        unauthorised = await client.get("/v1/conversations/conv-live/locality", headers={"Authorization": ""})
        assert unauthorised.status_code == 401


async def test_locality_of_a_stored_conversation_is_live_then_snapshot_after_a_restart_then_none(store):
    engine = ScriptedEngine(["Hello!"])
    async with serving(engine, store) as (_, client):
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"})
        conversation = first.headers[HEADER]
        live = (await client.get(f"/v1/conversations/{conversation}/locality")).json()
        assert live["locality"] == "live" and live["tokens"] > 0
    async with serving(ScriptedEngine([]), store) as (_, client):
        stored = (await client.get(f"/v1/conversations/{conversation}/locality")).json()
        assert stored == {"conversation_id": conversation, "locality": "snapshot", "tokens": stored["tokens"]}
        assert 0 < stored["tokens"] <= live["tokens"]
        for record in await store.snapshots(conversation):
            await store.delete_snapshot(record)
        none = (await client.get(f"/v1/conversations/{conversation}/locality")).json()
        assert none == {"conversation_id": conversation, "locality": "none", "tokens": 0}


# ---- /metrics --------------------------------------------------------------------------------
async def test_metrics_count_snapshot_saves_and_restores(store):
    engine = ScriptedEngine(["Hello!"])
    async with serving(engine, store) as (_, client):
        before = await scrape(client)
        first = await client.post("/v1/responses", json={"model": "scripted", "input": "Hi"})
        saved = await scrape(client)
    assert saved[SNAPSHOT_SAVES + "_total"] == before[SNAPSHOT_SAVES + "_total"] + 1
    assert saved[SNAPSHOT_RESTORES + "_total"] == before[SNAPSHOT_RESTORES + "_total"]
    assert saved["agentkv_live_conversations"] == 1
    async with serving(ScriptedEngine(["Still here."]), store) as (_, client):
        await client.post("/v1/responses", json={"model": "scripted", "input": "There?",
                                                 "previous_response_id": first.json()["id"]})
        restored = await scrape(client)
    assert restored[SNAPSHOT_RESTORES + "_total"] == saved[SNAPSHOT_RESTORES + "_total"] + 1
    assert restored[SNAPSHOT_SAVES + "_total"] == saved[SNAPSHOT_SAVES + "_total"] + 1
    assert "agentkv_prefix_cache_hit_tokens_total" in restored


async def test_metrics_add_up_the_cached_prompt_tokens_of_answered_requests():
    engine = ScriptedEngine(["Hello!", "Fine."])
    async with serving(engine) as (_, client):
        assert (await scrape(client))[CACHED_PROMPT_TOKENS + "_total"] == 0
        messages = [{"role": "user", "content": "Hi"}]
        await client.post("/v1/chat/completions", json=chat(messages))
        messages += [{"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "And you?"}]
        second = (await client.post("/v1/chat/completions", json=chat(messages))).json()
        cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0 and (await scrape(client))[CACHED_PROMPT_TOKENS + "_total"] == cached
