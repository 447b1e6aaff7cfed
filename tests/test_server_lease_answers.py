"""What the server answers a request that runs nothing (scripted engine, in process): a stream
refused before it began — its conversation's lease held by another replica, its named session
running another request — is an HTTP 409 with ``Retry-After``, not a 200 whose body is an error;
no answer but a 2xx names a session or a response (a session-affine proxy would learn the wrong
replica from it); a Responses stream the shutdown stops says ``response.created`` first, or
nothing; a client that hangs up while its request waits for a lease is not waited for."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
from sse_starlette.sse import AppStatus
from test_server_replicas import gated

from agentkv.errors import ConversationBusy
from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.server.app import STOPPED_BEFORE_START
from agentkv.server.decided_stream import DecidedStream
from agentkv.server.response_wire import ResponseRequest
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
RUN_HEADERS = ("X-Session-Id", "X-Response-Id")
ELSEWHERE = "replica-b:4242:test"
"""Another replica's lease holder (another host's ``host:pid:tag``): live until its lease expires."""


@asynccontextmanager
async def served(engine: ScriptedEngine, url: str | None = None, *,
                 lease_wait_s: float = 0.0) -> AsyncIterator[tuple[httpx.AsyncClient, object]]:
    """The app (started; with a store on ``url`` if given) and a client on it."""
    store = Store(url) if url is not None else None
    app = create_app(engine, store=store, api_key=KEY, model_id="scripted", lease_wait_s=lease_wait_s)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                     headers=AUTH) as client:
            yield client, app


def chat(content: str, **extra) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}


def respond(**body) -> dict:
    return {"model": "scripted", "temperature": 0, **body}


async def held_elsewhere(url: str, conversation_id: str) -> None:
    """Another replica takes the conversation's lease (as its run would)."""
    async with Store(url) as store:
        await store.acquire_lease(conversation_id, ELSEWHERE, ttl_s=60)


async def window_of(url: str, conversation_id: str) -> list[str]:
    async with Store(url) as store:
        return [m.message.content for m in await store.messages(conversation_id, in_window_only=True)]


def assert_refused(answer: httpx.Response, status: int, code: str) -> None:
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code, answer.text
    assert not set(RUN_HEADERS) & set(answer.headers), dict(answer.headers)


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'agentkv.db'}"


async def test_a_streamed_chat_completion_whose_named_session_is_running_is_409_with_retry_after():
    gate, started = anyio.Event(), anyio.Event()
    async with served(ScriptedEngine([gated("First.", gate, started), "Second."])) as (client, _):
        pinned = {"X-Session-Id": "pinned"}
        answers: dict[str, httpx.Response] = {}

        async def first() -> None:
            answers["first"] = await client.post("/v1/chat/completions", json=chat("go"), headers=pinned)

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(first)
            await started.wait()
            answers["busy"] = await client.post("/v1/chat/completions", json=chat("hi", stream=True), headers=pinned)
            gate.set()
        assert_refused(answers["busy"], 409, "conversation_busy")
        assert answers["busy"].headers["Retry-After"] == "1"
        assert answers["first"].status_code == 200 and answers["first"].headers["X-Session-Id"] == "pinned"
        again = await client.post("/v1/chat/completions", json=chat("hi", stream=True), headers=pinned)
        assert again.status_code == 200 and again.headers["X-Session-Id"] == "pinned"
        assert json.loads(again.text.split("data: ")[1])["choices"][0]["delta"]["role"] == "assistant"


@pytest.mark.parametrize("stream", [True, False])
async def test_a_response_whose_conversation_another_replica_holds_is_409_with_retry_after(url, stream):
    async with served(ScriptedEngine(["Hello!", "Again."]), url) as (client, _):
        first = await client.post("/v1/responses", json=respond(input="Hi"))
        session = first.headers["X-Session-Id"]
        await held_elsewhere(url, session)
        busy = await client.post("/v1/responses", json=respond(input="More", stream=stream,
                                                               previous_response_id=first.json()["id"]))
        assert_refused(busy, 409, "conversation_busy")
        assert busy.headers["Retry-After"] == "1"
    assert await window_of(url, session) == ["Hi", "Hello!"]  # the refused request ran nothing


async def test_no_answer_but_a_2xx_carries_a_session_or_response_id(url):
    gate, started = anyio.Event(), anyio.Event()
    async with served(ScriptedEngine(["Hello!", "Hello again!", gated("Pinned.", gate, started)]), url) as (client, _):
        first = (await client.post("/v1/responses", json=respond(input="Hi"))).json()
        other = (await client.post("/v1/responses", json=respond(input="Hi again"))).headers["X-Session-Id"]
        await held_elsewhere(url, other)
        named = {"X-Session-Id": "conv-1"}
        refused: list[httpx.Response] = []

        async def pinned_run() -> None:
            await client.post("/v1/chat/completions", json=chat("go"), headers={"X-Session-Id": "pinned"})

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(pinned_run)
            await started.wait()
            for stream in (False, True):
                refused += [
                    await client.post("/v1/chat/completions", json=chat("hi", stream=stream),
                                      headers={"X-Session-Id": "pinned"}),
                    await client.post("/v1/chat/completions", json={"model": "scripted", "stream": stream,
                                                                    "messages": []}, headers=named),
                    await client.post("/v1/responses", json=respond(input="x", stream=stream,
                                                                    previous_response_id="resp_unknown"),
                                      headers=named),
                    await client.post("/v1/responses", json=respond(input="x", stream=stream,
                                                                    previous_response_id=first["id"]),
                                      headers=named),
                    await client.post("/v1/responses", json=respond(input="x", stream=stream),
                                      headers={"X-Session-Id": other}),
                    await client.post("/v1/responses", json=respond(input="x", stream=stream),
                                      headers={**named, "Authorization": "Bearer wrong"}),
                ]
            gate.set()
    assert sorted({answer.status_code for answer in refused}) == [400, 401, 404, 409]
    for answer in refused:
        assert answer.status_code >= 400 and not set(RUN_HEADERS) & set(answer.headers), \
            (answer.status_code, answer.text, dict(answer.headers))


async def test_a_response_stream_stopped_before_its_first_event_says_nothing(url):
    async with served(ScriptedEngine(["Hello!"]), url) as (_, app):
        responses = app.state.responses  # type: ignore[attr-defined]
        plan = await responses.plan(ResponseRequest.model_validate(respond(input="Hi", stream=True)))
        stop = anyio.Event()
        stop.set()  # the server shuts down before the run's first event
        assert [event async for event in responses.stream(plan, stop=stop)] == []


async def test_a_response_stream_the_shutdown_stops_announces_the_response_before_it_fails(url):
    engine = ScriptedEngine(["one two three four five six seven eight"], decode_s_per_token=0.05)

    def shut_down_once_the_stream_is_open(message: dict) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            AppStatus.should_exit = True

    async with served(engine, url) as (_, app):
        try:
            with anyio.fail_after(30):
                sent = await drive(app, respond(input="Count", stream=True), hang_up=anyio.Event(),
                                   path="/v1/responses", on_send=shut_down_once_the_stream_is_open)
        finally:
            AppStatus.should_exit = False
    assert sent[0]["status"] == 200
    text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    kinds = [json.loads(line[5:])["type"] for line in text.splitlines() if line.startswith("data:")]
    assert kinds[0] == "response.created", kinds
    assert kinds[-1] == "response.failed" and "response.completed" not in kinds, kinds


async def test_a_stream_still_waiting_for_its_lease_when_the_server_shuts_down_is_a_503_and_runs_nothing(url):
    async with served(ScriptedEngine(["Hello!", "Again."]), url, lease_wait_s=30) as (client, app):
        first = await client.post("/v1/responses", json=respond(input="Hi"))
        session = first.headers["X-Session-Id"]
        await held_elsewhere(url, session)
        body = respond(input="More", stream=True, previous_response_id=first.json()["id"])
        sent: list[list[dict]] = []
        try:
            with anyio.fail_after(10):  # not the 30 s lease wait
                async with anyio.create_task_group() as tasks:

                    async def waiting() -> None:
                        sent.append(await drive(app, body, hang_up=anyio.Event(), path="/v1/responses"))

                    tasks.start_soon(waiting)
                    with anyio.fail_after(5):  # it is admitted, and waits for the lease
                        while (await client.get("/health")).json()["running"] != 1:
                            await anyio.sleep(0.05)
                    AppStatus.should_exit = True
        finally:
            AppStatus.should_exit = False
        [answer] = sent
        assert answer[0]["status"] == 503
        headers = {k.decode().lower(): v.decode() for k, v in answer[0]["headers"]}
        assert headers["retry-after"] and not {"x-session-id", "x-response-id"} & set(headers), headers
        assert (await client.get("/health")).json()["running"] == 0
        async with Store(url) as store:
            assert await store.lease_holder(session) == ELSEWHERE  # it took nothing, and holds nothing
    assert await window_of(url, session) == ["Hi", "Hello!"]  # and ran nothing


async def test_a_stream_that_ends_before_its_first_event_is_a_503_with_retry_after_and_no_run_headers():
    async def nothing() -> AsyncIterator[dict[str, str]]:
        return
        yield {}

    answer = DecidedStream(nothing(), headers={"X-Session-Id": "s1"}, stop=anyio.Event(), grace_s=1,
                           error_event=lambda api: {"data": api.message}, empty=STOPPED_BEFORE_START)
    sent = await drive(answer, {}, hang_up=anyio.Event())
    assert sent[0]["status"] == 503
    headers = {k.decode().lower(): v.decode() for k, v in sent[0]["headers"]}
    assert headers["retry-after"] == "1" and "x-session-id" not in headers


async def drive(app, body: dict, *, hang_up: anyio.Event, path: str = "/", headers: dict[str, str] | None = None,
                on_send=None) -> list[dict]:
    """Call the ASGI ``app`` with a POST of ``body`` (and ``headers``) whose client disconnects once
    ``hang_up`` is set; the messages it sent (each also handed to ``on_send`` as it goes)."""
    sent: list[dict] = []
    messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if messages:
            return messages.pop()
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if on_send is not None:
            on_send(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "server": ("test", 80), "client": ("127.0.0.1", 1234),
             "headers": [(b"authorization", f"Bearer {KEY}".encode()), (b"content-type", b"application/json"),
                         *[(k.encode(), v.encode()) for k, v in (headers or {}).items()]]}
    await app(scope, receive, send)
    return sent


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_hangs_up_while_waiting_for_a_lease_is_not_waited_for(url, stream):
    async with served(ScriptedEngine(["Hello!", "Again."]), url, lease_wait_s=30) as (client, app):
        first = await client.post("/v1/responses", json=respond(input="Hi"))
        session = first.headers["X-Session-Id"]
        await held_elsewhere(url, session)
        hang_up = anyio.Event()
        with anyio.fail_after(5):  # not the 30 s lease wait
            async with anyio.create_task_group() as tasks:
                sent_to: list[list[dict]] = []

                async def waiting() -> None:
                    sent_to.append(await drive(app, respond(input="More", stream=stream,
                                                            previous_response_id=first.json()["id"]),
                                               hang_up=hang_up, path="/v1/responses"))

                tasks.start_soon(waiting)
                with anyio.fail_after(4):  # admitted, and waiting for the lease
                    while (await client.get("/health")).json()["running"] != 1:
                        await anyio.sleep(0.05)
                hang_up.set()
        # nothing reached the client: a non-streamed answer is only the access log's 499, a stream sent nothing
        assert sent_to[0] == [] if stream else [m["status"] for m in sent_to[0] if "status" in m] == [499]
        assert (await client.get("/health")).json()["running"] == 0
        async with Store(url) as store:
            assert await store.lease_holder(session) == ELSEWHERE  # it took nothing, and holds nothing
            await store.release_lease(session, ELSEWHERE)
        again = await client.post("/v1/responses", json=respond(input="And now?",
                                                                previous_response_id=first.json()["id"]))
        assert again.status_code == 200, again.text
    assert await window_of(url, session) == ["Hi", "Hello!", "And now?", "Again."]


async def test_a_failed_first_request_whose_conversation_cannot_be_deleted_still_answers_its_own_error(
        url, monkeypatch, caplog):
    async def busy(self, conversation_id, **kwargs):
        raise ConversationBusy(conversation_id, ELSEWHERE, action="delete")

    monkeypatch.setattr(Store, "delete_conversation", busy)
    async with served(ScriptedEngine([RuntimeError("the model failed")]), url) as (client, _):
        with pytest.raises(RuntimeError, match="the model failed"):  # the run's own failure (a 500), not a 409
            await client.post("/v1/responses", json=respond(input="Hi"))
    assert "could not delete conversation" in caplog.text
