"""The HTTP app: OpenAI-compatible routes over one engine, with Bearer auth and OpenAI errors.

::

    app = create_app(open_engine(), api_key="sk-local")
    uvicorn.run(app, host="127.0.0.1", port=8000)

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (``stream`` as server-sent events),
``GET /health``. ``X-Session-Id`` (or the body's ``user``) pins a request to one KV session.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from sse_starlette.sse import EventSourceResponse

from agentkv.engine.base import Engine
from agentkv.errors import AgentKVError
from agentkv.runtime import Runtime
from agentkv.server.chat import ChatCompletions
from agentkv.server.errors import ApiError, api_error_handler, as_api_error, error_body, validation_error_handler
from agentkv.server.live_sessions import LiveSessions
from agentkv.server.wire import ChatCompletionRequest


def create_app(
    engine: Engine,
    *,
    api_key: str | None = None,
    model_id: str = "agentkv",
    max_sessions: int = 64,
    max_running: int = 64,
    reuse_kv: bool = True,
) -> FastAPI:
    """The app serving ``engine``. ``api_key``: Bearer token every route but ``/health`` needs;
    ``max_sessions``: KV sessions kept alive between requests; ``max_running``: requests at
    once (more get 429); ``reuse_kv=False`` runs every request on a fresh session."""
    runtime = Runtime(engine)
    live = LiveSessions(engine, max_sessions=max_sessions, reuse=reuse_kv)
    chat = ChatCompletions(runtime, live, model_id=model_id, max_running=max_running)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await live.aclose()
        await runtime.aclose()

    app = FastAPI(title="agentkv", lifespan=lifespan)
    app.state.chat = chat
    # NOTE: the errors a request can cause are handled by name (Starlette re-raises what only the
    # catch-all Exception handler answers, after sending the 500)
    for handled in (ApiError, AgentKVError, ValueError, Exception):
        app.add_exception_handler(handled, api_error_handler)
    app.add_exception_handler(RequestValidationError, validation_error_handler)

    def authorised(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise ApiError(401, "missing or wrong API key: send Authorization: Bearer <key>", "invalid_api_key")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "live_sessions": len(live), "running": chat.running}

    @app.get("/v1/models", dependencies=[Depends(authorised)])
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": created,
                                            "owned_by": "agentkv"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(authorised)], response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        pin = request.headers.get("x-session-id") or body.user
        tenant = _tenant(request)
        if not body.stream:
            return await chat.complete(body, pin=pin, tenant=tenant)
        prepared = chat.prepare(body, tenant=tenant)  # bad input is an HTTP error, before the stream starts

        async def events() -> AsyncIterator[dict[str, str]]:
            try:
                async for item in chat.stream(body, prepared, pin=pin):
                    yield {"data": json.dumps(item)}
            except Exception as error:  # after the headers: the error travels as an event
                api = as_api_error(error)
                yield {"data": json.dumps(error_body(api.status, api.message, api.code, api.param))}
                return
            yield {"data": "[DONE]"}

        return EventSourceResponse(events(), ping=15)

    return app


def _tenant(request: Request) -> str:
    """The namespace of the request's API key (a digest, so keys never sit in memory twice)."""
    header = request.headers.get("authorization", "")
    token = header.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:16] if token else ""
