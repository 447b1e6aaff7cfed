"""BearerAuth: the API key checked before anything else reads the request (its body included),
so an unauthenticated request is a 401 whatever it sends.

::

    app.add_middleware(BearerAuth, api_key="sk-local")     # every route but /health, /ready and /metrics needs the key
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from agentkv.server.errors import error_body

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
"""Routes served without the key (probes and metric scrapers: they carry no conversation)."""


class BearerAuth:
    """ASGI middleware: HTTP requests outside ``OPEN_PATHS`` need ``Authorization: Bearer <api_key>``."""

    def __init__(self, app: ASGIApp, *, api_key: str | None) -> None:
        """``api_key`` None serves everyone."""
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.api_key is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        scheme, _, token = Headers(scope=scope).get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(token.strip().encode(), self.api_key.encode()):
            await self.app(scope, receive, send)
            return
        refused = error_body(401, "missing or wrong API key: send Authorization: Bearer <key>", "invalid_api_key")
        await JSONResponse(refused, status_code=401)(scope, receive, send)
