"""Two replicas of the server on one store (two apps, each with its own engine and ``Store`` on the
same SQLite file, as two processes would be): a conversation moves between them on its snapshot
(and back: the replica it left restores the newer snapshot rather than re-read what it missed);
two requests for a conversation a replica has not opened yet run it once;
a request for a conversation the other replica is running waits for its lease, then answers 409
(``response_superseded`` once that run went past the response it continues, ``conversation_busy`` when
the run outlasts the wait); the history keeps each turn once; every answer names its response in
``X-Response-Id``; a draining server still serves while ``/ready`` says 503."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import pytest
import uvicorn
from sse_starlette.sse import AppStatus

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.server.draining import DrainingServer
from agentkv.server.readiness import Readiness
from agentkv.testing import ScriptedCall, ScriptedEngine

KEY = "sk-test"
AUTH = {"Authorization": f"Bearer {KEY}"}


@asynccontextmanager
async def replica(url: str, engine: ScriptedEngine, *, lease_wait_s: float = 5.0,
                  max_sessions: int = 64) -> AsyncIterator[httpx.AsyncClient]:
    """One replica: its own store connection and engine, the app started, a client on it."""
    async with Store(url) as store:
        app = create_app(engine, store=store, api_key=KEY, model_id="scripted", lease_wait_s=lease_wait_s,
                         max_sessions=max_sessions)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                         headers=AUTH) as client:
                yield client


async def respond(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/responses", json={"model": "scripted", "temperature": 0, **body})


def gated(text: str, gate: anyio.Event, started: anyio.Event):
    """A scripted reply that starts, then waits for ``gate`` before it answers ``text``."""
    async def reply(call: ScriptedCall) -> str:
        started.set()
        await gate.wait()
        return text
    return reply


async def while_a_runs(a: httpx.AsyncClient, first: dict, gate: anyio.Event, started: anyio.Event,
                       action: Callable[[], Awaitable[httpx.Response]]) -> tuple[httpx.Response, httpx.Response]:
    """Replica ``a`` continues ``first`` with a gated turn; once that turn runs, ``action`` (on the
    other replica), then the gate opens. Returns a's answer and the action's."""
    ran: list[httpx.Response] = []

    async def on_a() -> None:
        ran.append(await respond(a, input="Turn on a", previous_response_id=first["id"]))

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(on_a)
        await started.wait()
        answer = await action()
        gate.set()
    return ran[0], answer


async def window_of(url: str, conversation_id: str) -> list[str]:
    async with Store(url) as store:
        return [m.message.content for m in await store.messages(conversation_id, in_window_only=True)]


@pytest.fixture
def url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'replicas.db'}"


async def test_a_conversation_moves_to_the_other_replica_on_its_snapshot_and_back(url):
    async with replica(url, ScriptedEngine(["Hello!", "Back on a."])) as a, \
            replica(url, ScriptedEngine(["On b now."])) as b:
        first = await respond(a, input="Hi")
        assert first.status_code == 200 and first.headers["X-Response-Id"] == first.json()["id"]
        moved = await respond(b, input="Still there?", previous_response_id=first.json()["id"])
        assert moved.status_code == 200, moved.text
        usage = moved.json()["usage"]
        assert usage["input_tokens_details"]["cached_tokens"] >= first.json()["usage"]["input_tokens"]  # restored
        back = await respond(a, input="And now?", previous_response_id=moved.json()["id"])
        assert back.status_code == 200, back.text
        # a's own KV stops at its first turn: it restores b's newer snapshot rather than re-read b's turn
        assert back.json()["usage"]["input_tokens_details"]["cached_tokens"] >= usage["input_tokens"]
        session = back.headers["X-Session-Id"]
    assert await window_of(url, session) == ["Hi", "Hello!", "Still there?", "On b now.", "And now?", "Back on a."]


async def test_a_request_for_a_conversation_the_other_replica_runs_waits_then_is_superseded(url):
    gate, started = anyio.Event(), anyio.Event()
    async with replica(url, ScriptedEngine(["Hello!", gated("A's answer.", gate, started)])) as a, \
            replica(url, ScriptedEngine(["never used"])) as b:
        first = (await respond(a, input="Hi")).json()
        answers: dict[str, httpx.Response] = {}

        async def on(name: str, client: httpx.AsyncClient, text: str) -> None:
            answers[name] = await respond(client, input=text, previous_response_id=first["id"])

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(on, "a", a, "Turn on a")
            await started.wait()
            tasks.start_soon(on, "b", b, "Turn on b")
            await anyio.sleep(0.5)  # b waits for the lease a holds
            assert "b" not in answers
            gate.set()
        assert answers["a"].status_code == 200, answers["a"].text
        assert answers["b"].status_code == 409, answers["b"].text
        error = answers["b"].json()["error"]
        assert error["code"] == "response_superseded" and answers["a"].json()["id"] in error["message"]
    assert await window_of(url, first_session(answers)) == ["Hi", "Hello!", "Turn on a", "A's answer."]
    async with Store(url) as store:  # the refused request saved no snapshot of its older KV
        sizes = [r.num_tokens for r in await store.snapshots(first_session(answers))]
    assert sizes[0] == max(sizes), sizes


async def test_a_request_whose_wait_for_the_other_replica_runs_out_is_session_busy(url):
    gate, started = anyio.Event(), anyio.Event()
    async with replica(url, ScriptedEngine(["Hello!", gated("A's answer.", gate, started)])) as a, \
            replica(url, ScriptedEngine(["never used"]), lease_wait_s=0.3) as b:
        first = (await respond(a, input="Hi")).json()
        ran, busy = await while_a_runs(a, first, gate, started,
                                       lambda: respond(b, input="Turn on b", previous_response_id=first["id"]))
        assert busy.status_code == 409 and busy.json()["error"]["code"] == "conversation_busy", busy.text
        assert ran.status_code == 200
    assert await window_of(url, ran.headers["X-Session-Id"]) == ["Hi", "Hello!", "Turn on a", "A's answer."]


def first_session(answers: dict[str, httpx.Response]) -> str:
    return answers["a"].headers["X-Session-Id"]


async def test_a_streamed_response_names_its_response_and_conversation_in_headers(url):
    async with replica(url, ScriptedEngine(["Hello!"])) as a:
        request = {"model": "scripted", "input": "Hi", "stream": True}
        async with a.stream("POST", "/v1/responses", json=request) as streamed:
            events = [line async for line in streamed.aiter_lines() if line.startswith("data:")]
            response_id = streamed.headers["X-Response-Id"]
            assert streamed.headers["X-Session-Id"]
        assert response_id.startswith("resp_") and response_id in events[-1]


async def test_the_first_sigterm_drains_ready_says_503_while_requests_are_still_served_then_it_stops():
    readiness = Readiness(None)
    readiness.start()
    server = DrainingServer(uvicorn.Config(app=lambda *_: None), readiness=readiness, drain_s=0.3)
    server.handle_exit(signal.SIGTERM, None)
    assert not server.should_exit and (await readiness.check())[0] is False
    assert "draining" in (await readiness.check())[1]
    assert await server.on_tick(1) is False  # still serving
    await anyio.sleep(0.35)
    assert await server.on_tick(2) is True  # the drain is over: uvicorn's graceful shutdown
    again = DrainingServer(uvicorn.Config(app=lambda *_: None), readiness=Readiness(None), drain_s=0.3)
    again.handle_exit(signal.SIGTERM, None)
    try:
        again.handle_exit(signal.SIGTERM, None)  # a second SIGTERM: uvicorn's graceful shutdown at once
        assert again.should_exit
    finally:  # NOTE: uvicorn's handler, as sse-starlette patches it, flags every stream of this process
        AppStatus.should_exit = False


async def test_shutting_down_snapshots_an_open_conversation_whose_snapshot_is_missing_and_only_that(url):
    async with replica(url, ScriptedEngine(["Hello!", "Again."])) as a:
        kept = (await respond(a, input="Hi")).headers["X-Session-Id"]
        lost = (await respond(a, input="Hi there")).headers["X-Session-Id"]
        async with Store(url) as store:
            for record in await store.snapshots(lost):  # e.g. its turn-end save failed
                await store.delete_snapshot(record)
            before = {sid: [r.path for r in await store.snapshots(sid)] for sid in (kept, lost)}
    assert before[lost] == [] and len(before[kept]) == 1
    async with Store(url) as store:
        assert [r.path for r in await store.snapshots(kept)] == before[kept]  # not saved again
        assert len(await store.snapshots(lost)) == 1  # saved by the shutdown


async def test_two_requests_for_a_conversation_this_replica_has_not_opened_run_it_once(url):
    gate, started = anyio.Event(), anyio.Event()
    opened: list = []
    b_engine = ScriptedEngine([gated("B's answer.", gate, started), "never used"])
    open_session = b_engine.open_session

    async def counting(**options):
        opened.append(await open_session(**options))
        return opened[-1]

    b_engine.open_session = counting  # type: ignore[method-assign]
    async with replica(url, ScriptedEngine(["Hello!"])) as a, replica(url, b_engine) as b:
        first = (await respond(a, input="Hi")).json()
        answers: dict[str, httpx.Response] = {}

        async def on(name: str) -> None:
            answers[name] = await respond(b, input=f"Turn {name}", previous_response_id=first["id"])

        async with anyio.create_task_group() as tasks:  # both resume it at once on b
            tasks.start_soon(on, "x")
            tasks.start_soon(on, "y")
            await started.wait()
            await anyio.sleep(0.2)
            gate.set()
        codes = sorted(answer.status_code for answer in answers.values())
        assert codes == [200, 409], {k: v.text for k, v in answers.items()}
        ran = next(name for name, answer in answers.items() if answer.status_code == 200)
        session = answers[ran].headers["X-Session-Id"]
    assert await window_of(url, session) == ["Hi", "Hello!", f"Turn {ran}", "B's answer."]
    assert len(opened) == 1  # one conversation, one KV session (and it was closed at shutdown)


async def test_deleting_a_response_whose_conversation_the_other_replica_is_running_is_409(url):
    gate, started = anyio.Event(), anyio.Event()
    async with replica(url, ScriptedEngine(["Hello!", gated("A's answer.", gate, started)])) as a, \
            replica(url, ScriptedEngine([])) as b:
        first = (await respond(a, input="Hi")).json()
        ran, refused = await while_a_runs(a, first, gate, started, lambda: b.delete(f"/v1/responses/{first['id']}"))
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "conversation_busy", refused.text
        assert ran.status_code == 200  # the run went on, its conversation intact
        deleted = await b.delete(f"/v1/responses/{first['id']}")  # once it is over: not the last response
        assert deleted.status_code == 200
    assert await window_of(url, ran.headers["X-Session-Id"]) == ["Hi", "Hello!", "Turn on a", "A's answer."]


async def test_a_conversation_closed_to_make_room_is_snapshotted_first_when_its_snapshot_is_missing(url):
    async with replica(url, ScriptedEngine(["Hello!", "Again."]), max_sessions=1) as a:
        first = (await respond(a, input="Hi")).headers["X-Session-Id"]
        async with Store(url) as store:
            for record in await store.snapshots(first):  # e.g. its turn-end save failed
                await store.delete_snapshot(record)
        await respond(a, input="Another conversation")  # the first is closed to make room
        async with Store(url) as store:
            assert len(await store.snapshots(first)) == 1
