"""AccessLog: one line per HTTP request on the ``agentkv.server.access`` logger — method, path,
status, duration (to the last byte of a stream), and what the route noted: the completion or
response id, the conversation (the ``X-Session-Id``), the prompt tokens whose KV was reused (and,
of those the store restored, the tokens each tier gave: ``kv_from=host:64,s3:320``).

::

    app.add_middleware(AccessLog, served=ServedCounts())      # served: what /metrics adds up
    AccessNote.of(request).update(id="resp_1", conversation="sess_1", cached_tokens=120)   # in a route
    # → POST /v1/responses 200 412.3ms id=resp_1 conversation=sess_1 cached_tokens=120
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from agentkv.observe.metrics import ServedCounts

ACCESS_LOGGER = logging.getLogger("agentkv.server.access")


@dataclass
class AccessNote:
    """What a route tells the access log about its request (None: not known)."""

    id: str | None = None
    """The ``chatcmpl-…`` / ``resp_…`` id."""
    conversation: str | None = None
    """The conversation's id (``X-Session-Id``): a chat request's live KV session, or a response's
    stored conversation."""
    cached_tokens: int | None = None
    """Prompt tokens whose KV was reused instead of computed."""
    kv_from: dict[str, int] | None = None
    """Of those, the tokens the store's tiers gave, by tier (``{"host": 64, "s3": 320}``)."""

    @classmethod
    def of(cls, request: Request) -> AccessNote:
        """The request's note (a fresh one outside ``AccessLog``)."""
        note = request.scope.setdefault("state", {}).setdefault("access_note", cls())
        assert isinstance(note, cls)
        return note

    def update(self, *, id: str | None = None, conversation: str | None = None, cached_tokens: int | None = None,
               kv_from: dict[str, int] | None = None) -> None:
        """Set the fields given (the others keep their value)."""
        self.id = id or self.id
        self.conversation = conversation or self.conversation
        self.cached_tokens = self.cached_tokens if cached_tokens is None else cached_tokens
        self.kv_from = kv_from or self.kv_from


class AccessLog:
    """ASGI middleware writing the access line once the response is sent (or the client left)."""

    def __init__(self, app: ASGIApp, served: ServedCounts | None = None) -> None:
        """``served``: adds up each request's cached tokens (for ``/metrics``)."""
        self.app = app
        self.served = served

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        note = AccessNote()
        scope.setdefault("state", {})["access_note"] = note
        status = 0  # NOTE: stays 0 when no response started (the client hung up first)
        started = time.perf_counter()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except BaseException:
            status = status or 500  # an unhandled error: the error middleware outside answers 500
            raise
        finally:
            if self.served is not None and note.cached_tokens is not None:
                self.served.cached_prompt_tokens += note.cached_tokens
            tiers = "" if not note.kv_from else " kv_from=" + ",".join(f"{t}:{n}" for t, n in note.kv_from.items())
            ACCESS_LOGGER.info("%s %s %d %.1fms id=%s conversation=%s cached_tokens=%s%s", scope["method"],
                               scope["path"], status, (time.perf_counter() - started) * 1000, note.id or "-",
                               note.conversation or "-", "-" if note.cached_tokens is None else note.cached_tokens,
                               tiers)
