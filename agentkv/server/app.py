"""The HTTP app: OpenAI-compatible routes over one engine, with Bearer auth and OpenAI errors.

::

    app = create_app(open_engine(), api_key="sk-local")
    uvicorn.run(app, host="127.0.0.1", port=8000)

    app = create_app(engine, store=Store("sqlite:///responses.db"))   # /v1/responses kept and chained

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` and ``POST /v1/responses`` (``stream`` as
server-sent events), ``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/conversations/{id}/locality``
(``agentkv.server.locality``), ``GET /health``, ``GET /ready`` (``agentkv.server.readiness``),
``GET /metrics`` (Prometheus text: queued and running requests, KV-cache use…, ``agentkv.observe.metrics``).
``X-Session-Id`` names a request's conversation and every answer that ran it (a 2xx) carries it
back (``agentkv.server.conversation_ids``): on chat completions it pins the request to that live KV
session (else the body's ``user`` does, else the session continuing its history is used); on
responses it names the stored conversation. An error answer never carries it (nor
``X-Response-Id``): a streamed request refused as its run begins — the conversation another
replica holds, a named session another request runs — is a 409 with ``Retry-After`` before any
event (``agentkv.server.decided_stream``). A client that hangs up before its answer stops its
request (``agentkv.server.hang_ups``). The key is checked before the body is read; every error is
an OpenAI error object; each request leaves one line on the access log
(``agentkv.server.access``); on shutdown ``/ready`` answers 503 and open streams end with a last
event.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.exceptions import RequestValidationError
from openai.types import Model
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentkv.engine.base import Engine
from agentkv.errors import AgentKVError
from agentkv.memory import Store
from agentkv.memory.block_metrics import BlockStoreCollector
from agentkv.server.kv_collector import COLLECT_INTERVAL_S, collect_blocks_every
from agentkv.server.kv_saves import KVSavesCollector
from agentkv.observe.metrics import ServedCounts, ServerCollector, ServerLoad, registry_of
from agentkv.runtime.runtime import Runtime
from agentkv.server.access_log import AccessLog, AccessNote
from agentkv.server.auth import BearerAuth
from agentkv.server.chat import ChatCompletions
from agentkv.server.decided_stream import DecidedStream
from agentkv.server.errors import (
    RETRY_LATER,
    ApiError,
    api_error_handler,
    error_body,
    http_error_handler,
    validation_error_handler,
)
from agentkv.server.hang_ups import CLIENT_CLOSED_REQUEST, unless_hung_up
from agentkv.server.live_sessions import LiveSessions
from agentkv.server.locality import Locality
from agentkv.server.open_conversations import OpenConversations
from agentkv.server.readiness import Readiness
from agentkv.server.request_agents import AgentDefaults, RequestAgents
from agentkv.server.response_wire import ResponseRequest
from agentkv.server.responses import Responses
from agentkv.server.runs import Runs
from agentkv.server.conversation_ids import SESSION_HEADER, check_conversation_id, requested_conversation_id
from agentkv.server.wire import ChatCompletionRequest, as_wire

SHUTDOWN_GRACE_S = 5.0
"""Seconds a stream has to end itself once the server shuts down (below uvicorn's
``timeout_graceful_shutdown``, after which connections are cut)."""
STOPPED_BEFORE_START = ApiError(503, "the server is shutting down: the request was stopped before it began; send it "
                                     "again", "server_shutting_down", headers=RETRY_LATER)
"""The answer to a stream the server's shutdown stopped before its first event (nothing ran)."""


def create_app(
    engine: Engine,
    *,
    store: Store | None = None,
    api_key: str | None = None,
    model_id: str = "agentkv",
    max_sessions: int = 64,
    max_running: int = 64,
    reuse_kv: bool = True,
    defaults: AgentDefaults | None = None,
    lease_wait_s: float = 0.0,
    collect_interval_s: float = COLLECT_INTERVAL_S,
) -> FastAPI:
    """The app serving ``engine``. ``store``: where responses and their conversations are kept
    (without one, ``/v1/responses`` serves ``store=false`` only); ``api_key``: Bearer token every
    route but ``/health`` needs; ``max_sessions``: KV sessions kept alive between requests (chat
    sessions and stored conversations, each); ``max_running``: requests at once (more get 429);
    ``reuse_kv=False`` runs every chat request on a fresh session; ``defaults``: the agent
    settings of requests that set none; ``lease_wait_s``: how long a stored conversation another
    replica of this server is running is waited for (then 409); ``collect_interval_s``: seconds
    between two collections of the store's unreferenced KV blocks (0: none)."""
    runtime = Runtime(engine)
    stored = Runtime(engine, store, lease_wait_s=lease_wait_s) if store is not None else None
    live = LiveSessions(engine, max_sessions=max_sessions, reuse=reuse_kv)
    runs = Runs(runtime, live, max_running=max_running, store=store)
    agents = RequestAgents([r for r in (runtime, stored) if r is not None], defaults)
    chat = ChatCompletions(runs, agents, model_id=model_id)
    conversations = OpenConversations(stored, max_open=max_sessions) if stored is not None else None
    responses = Responses(runs, agents, conversations, store, model_id=model_id)
    readiness = Readiness(store)
    locality = Locality(live, conversations, store, fingerprint=engine.fingerprint)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        readiness.start()  # the engine was compiled before the app was made
        # NOTE: a task, not a task group around the yield: a lifespan may be entered and exited in
        # different tasks (ASGI lifespan managers in tests do), which a cancel scope refuses
        collector = (asyncio.get_running_loop().create_task(collect_blocks_every(store, collect_interval_s))
                     if store is not None and collect_interval_s else None)
        yield
        if collector is not None:
            collector.cancel()
        readiness.drain()
        # NOTE: runs still going were cancelled by the server's shutdown: each snapshotted its
        # conversation's KV as it ended, so closing loses nothing a restart could resume
        await responses.aclose()
        await runs.aclose()  # NOTE: the KV saves of the last turns, before the store closes
        await live.aclose()
        await runtime.aclose()
        if store is not None:
            await store.close()

    app = FastAPI(title="agentkv", lifespan=lifespan)
    app.state.chat, app.state.responses, app.state.readiness = chat, responses, readiness
    # NOTE: the errors a request can cause are handled by name (Starlette re-raises what only the
    # catch-all Exception handler answers, after sending the 500)
    for handled in (ApiError, AgentKVError, ValueError, Exception):
        app.add_exception_handler(handled, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)
    app.add_exception_handler(StarletteHTTPException, http_error_handler)
    # NOTE: the key is checked before the body is read (an unauthenticated request is a 401 whatever
    # it sends); the access log is outermost, so refused requests are logged too
    app.add_middleware(BearerAuth, api_key=api_key)
    served = ServedCounts()
    app.add_middleware(AccessLog, served=served)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "live_sessions": len(live), "running": runs.running,
                "open_conversations": len(conversations) if conversations is not None else 0}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        ok, reason = await readiness.check()
        return JSONResponse({"status": "ready" if ok else "not_ready", "reason": reason},
                            status_code=200 if ok else 503)

    collector = ServerCollector(engine, lambda: ServerLoad(
        running=runs.running - runs.waiting, waiting=runs.waiting,
        live_conversations=len(live) + (len(conversations) if conversations is not None else 0)), served=served)
    registry = registry_of(collector)
    if store is not None:
        registry.register(BlockStoreCollector(store.blocks))
        registry.register(KVSavesCollector(runs.saves))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        model = Model(id=model_id, object="model", created=created, owned_by="agentkv")
        return {"object": "list", "data": [as_wire(model)]}

    @app.get("/v1/conversations/{conversation_id}/locality")
    async def session_locality(conversation_id: str, request: Request) -> dict[str, Any]:
        return await locality.of(check_conversation_id(conversation_id), tenant=_tenant(request))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        named = requested_conversation_id(request.headers)
        pin = named or body.user
        tenant, note = _tenant(request), AccessNote.of(request)
        prepared = chat.prepare(body, tenant=tenant)  # bad input is an HTTP error, before the stream starts
        conversation_id = chat.route(prepared, conversation_id=named, pin=pin)
        if not body.stream:
            answer = await unless_hung_up(request.receive, chat.complete(
                body, prepared, conversation_id=conversation_id, pin=pin, note=note))
            if answer is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(answer, headers={SESSION_HEADER: conversation_id})
        stop = anyio.Event()

        async def events() -> AsyncGenerator[dict[str, str], None]:
            async for item in chat.stream(body, prepared, conversation_id=conversation_id, pin=pin, note=note,
                                          stop=stop):
                yield {"data": json.dumps(item)}
            yield {"data": "[DONE]"}

        return _event_stream(events(), stop, {SESSION_HEADER: conversation_id}, _chat_error_event)

    @app.post("/v1/responses", response_model=None)
    async def create_response(body: ResponseRequest, request: Request) -> Any:
        named = requested_conversation_id(request.headers)
        plan = await responses.plan(body, tenant=_tenant(request), conversation_id=named)
        note = AccessNote.of(request)
        if not body.stream:
            answer = await unless_hung_up(request.receive, responses.create(plan, note=note))
            if answer is None:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            return JSONResponse(answer, headers=plan.headers)
        stop = anyio.Event()

        async def sse() -> AsyncGenerator[dict[str, str], None]:
            async for event in responses.stream(plan, note=note, stop=stop):
                yield {"event": str(event["type"]), "data": json.dumps(event)}

        return _event_stream(sse(), stop, plan.headers, _response_error_event)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.get(response_id, tenant=_tenant(request))

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request) -> dict[str, Any]:
        return await responses.delete(response_id, tenant=_tenant(request))

    return app


def _event_stream(events: AsyncGenerator[dict[str, str], None], stop: anyio.Event, headers: dict[str, str],
                  error_event: Callable[[ApiError], dict[str, str]]) -> DecidedStream:
    """Server-sent ``events``, with ``headers`` (the conversation's ``X-Session-Id``…) once the first
    event is there (an error before it is an error answer without them: ``DecidedStream``); on the
    server's shutdown ``stop`` is set and the stream has ``SHUTDOWN_GRACE_S`` to end itself (a last
    event, then the end of the body) before it is cut."""
    return DecidedStream(events, headers=headers, stop=stop, error_event=error_event, empty=STOPPED_BEFORE_START,
                         grace_s=SHUTDOWN_GRACE_S)


def _chat_error_event(api: ApiError) -> dict[str, str]:
    """A chat stream's last event when an error ends it after its first."""
    return {"data": json.dumps(error_body(api.status, api.message, api.code, api.param))}


def _response_error_event(api: ApiError) -> dict[str, str]:
    """A Responses stream's last event when an error ends it after its first."""
    return {"event": "error", "data": json.dumps({"type": "error", "code": api.code, "message": api.message,
                                                  "param": api.param})}


def _tenant(request: Request) -> str:
    """The namespace of the request's API key (a digest, so keys never sit in memory twice)."""
    header = request.headers.get("authorization", "")
    token = header.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""
