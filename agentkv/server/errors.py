"""OpenAI-style error responses: agentkv's exceptions mapped to the status and error object an
OpenAI client expects (``{"error": {"message", "type", "param", "code"}}``, the openai package's
``ErrorObject``). A refusal that a later try may not meet (a conversation another request or
replica is running, a full server) says when to try again in ``Retry-After``.

::

    raise ApiError(429, "the server is busy: 32 requests are running; retry later", "rate_limit_exceeded",
                   headers=RETRY_LATER)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from openai.types.shared import ErrorObject
from starlette.exceptions import HTTPException as StarletteHTTPException

from agentkv.errors import (
    ConstraintError,
    ContextOverflowError,
    LeaseLost,
    ResponseNotFound,
    ResponseSuperseded,
    ConversationBusy,
    ConversationExists,
    UserError,
)
from agentkv.validation_text import describe_problems

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error",
          500: "server_error", 503: "server_error"}

RETRY_AFTER_S = 1
"""Seconds a refused request is told to wait (``Retry-After``) before it tries again: a busy
conversation's run or a full server's requests usually end within that (a proxy may also send
the retry to another replica)."""
RETRY_LATER = {"Retry-After": str(RETRY_AFTER_S)}
"""The headers of a refusal worth retrying."""


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI error object."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None, *,
                 headers: Mapping[str, str] | None = None) -> None:
        """``headers``: what the answer carries besides the error (``RETRY_LATER``)."""
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.headers = dict(headers or {})


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """The body of an error answer: the openai package's ``ErrorObject`` under ``error``::

        error_body(404, "no stored response 'resp_1'", "response_not_found")
    """
    error = ErrorObject(message=message, type=_TYPES.get(status, "invalid_request_error"), param=param, code=code)
    return {"error": error.model_dump(mode="json", exclude_unset=True)}


def as_api_error(error: BaseException) -> ApiError:
    """The status an agentkv exception deserves (500 for anything unexpected); a conversation
    that is running (here or on another replica) is a 409 with ``Retry-After``."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ContextOverflowError):
        return ApiError(413, str(error), "context_length_exceeded", "messages")
    if isinstance(error, ResponseNotFound):
        return ApiError(404, str(error), "response_not_found")
    if isinstance(error, ConversationBusy):
        return ApiError(409, str(error), "conversation_busy", headers=RETRY_LATER)
    if isinstance(error, ConversationExists):
        return ApiError(409, str(error), "conversation_conflict")
    if isinstance(error, ResponseSuperseded):
        return ApiError(409, str(error), "response_superseded", "previous_response_id")
    if isinstance(error, LeaseLost):
        return ApiError(409, str(error), "conversation_lease_lost", headers=RETRY_LATER)
    if isinstance(error, (UserError, ConstraintError, ValueError)):
        return ApiError(400, str(error), "invalid_request")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", "internal_error")


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    return error_answer(as_api_error(error))


def error_answer(api: ApiError) -> JSONResponse:
    """The answer to a refused request: ``api``'s status, error object and headers only (never
    the ``X-Session-Id`` / ``X-Response-Id`` of a run: none ran)::

        error_answer(ApiError(409, "conversation 'c1' is running", "conversation_busy", headers=RETRY_LATER))
    """
    return JSONResponse(error_body(api.status, api.message, api.code, api.param), status_code=api.status,
                        headers=api.headers)


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A body that does not validate: 400 (OpenAI's status), naming the first bad field; a body
    that is not JSON, or none, says so."""
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    first = problems[0] if problems else {}
    if first.get("type") == "json_invalid":
        position = first.get("loc", ("body", "?"))[-1]
        reason = (first.get("ctx") or {}).get("error", "JSON decode error")
        return _answer(400, f"the request body is not valid JSON ({reason} at character {position}): send one "
                            "JSON object with Content-Type: application/json", "invalid_json")
    location = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    if not location:  # the body as a whole: none, or not an object
        what = "empty" if first.get("type") == "missing" else "not a JSON object"
        return _answer(400, f"the request body is {what}: send one JSON object with Content-Type: application/json",
                       "invalid_json")
    message = describe_problems(problems, root="", skip=("body",))
    return _answer(400, message or "invalid request body", "invalid_request", location or None)


async def http_error_handler(request: Request, error: Exception) -> JSONResponse:
    """Starlette's own HTTP errors (no such route, wrong method, a body it cannot read) as
    OpenAI error objects."""
    assert isinstance(error, StarletteHTTPException)
    route = f"{request.method} {request.url.path}"
    if error.status_code == 404:
        return _answer(404, f"no route {route}: the routes are /v1/models, /v1/chat/completions, /v1/responses, "
                            "/v1/conversations/{id}/locality, /health, /ready and /metrics", "not_found")
    if error.status_code == 405:
        return _answer(405, f"{route} is not allowed: see the Allow header for the methods this route takes",
                       "method_not_allowed", headers=error.headers)
    if error.status_code == 400:
        return _answer(400, "the request body could not be read (is it UTF-8 JSON?): send one JSON object "
                            "encoded as UTF-8 with Content-Type: application/json", "invalid_json")
    return _answer(error.status_code, str(error.detail), None, headers=error.headers)


def _answer(status: int, message: str, code: str | None, param: str | None = None,
            headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)
