"""Conversation ids on the wire: the ``X-Session-Id`` header read, checked and made, so a
session-affine proxy can hash on one key per conversation.

A request's header names its conversation; every answer that ran it (a 2xx, never an error)
carries the header back (the id the request was given, or the one the server derived: the
conversation of ``previous_response_id``, the live KV session a chat request matched, or a new
id)::

    conversation_id = requested_conversation_id(request.headers)     # None: no header; ApiError 400: a bad one
    response.headers[SESSION_HEADER] = conversation_id or new_conversation_id()
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping

from agentkv.server.errors import ApiError

SESSION_HEADER = "X-Session-Id"
"""The header that names a request's conversation (read case-insensitively, echoed as spelled here)."""
MAX_SESSION_ID_LEN = 128
"""The longest conversation id accepted."""
_VALID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")


def requested_conversation_id(headers: Mapping[str, str]) -> str | None:
    """The request's ``X-Session-Id`` (None without one); ``ApiError`` 400 for an empty, too
    long or oddly spelled one::

        requested_conversation_id({"x-conversation-id": "conv-42"})     # "conv-42"
    """
    value = next((v for k, v in headers.items() if k.lower() == SESSION_HEADER.lower()), None)
    if value is None:
        return None
    check_conversation_id(value)
    return value


def check_conversation_id(value: str) -> str:
    """``value`` if it is a valid conversation id, else ``ApiError`` 400 saying what one looks like::

        check_conversation_id("conv-42")
    """
    if not value:
        problem = "is empty"
    elif len(value) > MAX_SESSION_ID_LEN:
        problem = f"is {len(value)} characters long, over the {MAX_SESSION_ID_LEN} allowed"
    elif _VALID.fullmatch(value) is None:
        problem = f"{value[:40]!r} has characters other than letters, digits and . _ : @ - (or starts with one)"
    else:
        return value
    raise ApiError(400, f"the {SESSION_HEADER} header {problem}: send 1 to {MAX_SESSION_ID_LEN} letters, digits "
                        "or . _ : @ - starting with a letter or digit, or leave the header out to get an id",
                   "invalid_conversation_id", SESSION_HEADER)


def new_conversation_id() -> str:
    """A fresh conversation id (``sess_`` and 24 hex digits)::

        new_conversation_id()      # "sess_3f2a…"
    """
    return "sess_" + uuid.uuid4().hex[:24]
