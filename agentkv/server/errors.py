"""OpenAI-style error responses: agentkv's exceptions mapped to the status and error object an
OpenAI client expects (``{"error": {"message", "type", "param", "code"}}``).

::

    raise ApiError(429, "the server is busy: 32 requests are running; retry later", "rate_limit_exceeded")
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from agentkv.errors import ConstraintError, ContextOverflowError, ResponseNotFound, SessionBusy, UserError
from agentkv.validation_text import describe_problems

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "server_error"}


class ApiError(Exception):
    """An error answered with ``status`` and an OpenAI error object."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def as_api_error(error: BaseException) -> ApiError:
    """The status an agentkv exception deserves (500 for anything unexpected)."""
    if isinstance(error, ApiError):
        return error
    if isinstance(error, ContextOverflowError):
        return ApiError(413, str(error), "context_length_exceeded", "messages")
    if isinstance(error, ResponseNotFound):
        return ApiError(404, str(error), "response_not_found")
    if isinstance(error, SessionBusy):
        return ApiError(409, str(error), "session_busy")
    if isinstance(error, (UserError, ConstraintError, ValueError)):
        return ApiError(400, str(error), "invalid_request")
    return ApiError(500, f"internal error: {type(error).__name__}: {error}", "internal_error")


async def api_error_handler(request: Request, error: Exception) -> JSONResponse:
    api = as_api_error(error)
    return JSONResponse(error_body(api.status, api.message, api.code, api.param), status_code=api.status)


async def validation_error_handler(request: Request, error: Exception) -> JSONResponse:
    """A body that does not validate: 400 (OpenAI's status), naming the first bad field."""
    assert isinstance(error, RequestValidationError)
    problems = error.errors()
    first = problems[0] if problems else {}
    location = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = describe_problems(problems, root="", skip=("body",))
    return JSONResponse(error_body(400, message or "invalid request body", "invalid_request", location or None),
                        status_code=400)
