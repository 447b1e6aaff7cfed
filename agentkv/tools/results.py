"""Turn what a tool returned into the text the model reads, capped to a size.

::

    serialize_result({"temp": 21.5})              # '{"temp": 21.5}'
    serialize_result(b"caf\xc3\xa9")              # 'café': UTF-8 bytes are text
    truncate_text("x" * 10, max_chars=4)          # 'xxxx…[truncated 6 chars]'

What cannot become text (bytes that are not UTF-8, anywhere in the result) raises
``ToolResultNotText``: the tool ran, its result could not be sent (``run_tool_calls`` says so).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from agentkv.chat.surrogates import replace_lone_surrogates
from agentkv.errors import ToolResultNotText


def serialize_result(result: Any) -> str:
    """Text for the model: ``str`` as is, UTF-8 bytes decoded, pydantic models as their JSON,
    anything else as JSON; lone surrogates become U+FFFD.

    ``None`` becomes ``""``. Values JSON cannot hold (datetimes, dataclasses, sets, ...) go through
    pydantic's JSON conversion, and as a last resort ``str()``. Raises ``ToolResultNotText`` for
    what has no text form (bytes that are not UTF-8, a circular structure).
    """
    if result is None:
        return ""
    if isinstance(result, str):
        return str(replace_lone_surrogates(result))
    try:
        if isinstance(result, (bytes, bytearray, memoryview)):
            return bytes(result).decode("utf-8")
        if isinstance(result, BaseModel):
            return result.model_dump_json()
        return str(replace_lone_surrogates(json.dumps(result, ensure_ascii=False, default=_jsonable)))
    except (ValueError, TypeError) as error:  # UnicodeDecodeError, pydantic's serialisation errors
        kind = type(result).__name__
        raise ToolResultNotText(
            f"the {kind} result has no text form ({type(error).__name__}: {error}); return str, or "
            "JSON-able values with binary data encoded (e.g. base64.b64encode(data).decode())",
            type_name=kind,
        ) from error


def _jsonable(value: Any) -> Any:
    """``json.dumps`` fallback for values it does not know."""
    return to_jsonable_python(value, fallback=str)


def truncation_marker(dropped_chars: int) -> str:
    """The visible note appended where text was cut."""
    return f"…[truncated {dropped_chars} chars]"


def truncate_text(text: str, max_chars: int | None) -> str:
    """Keep the first ``max_chars`` characters and say how many were cut; ``None`` keeps all."""
    if max_chars is None or len(text) <= max_chars:
        return text
    return text[:max_chars] + truncation_marker(len(text) - max_chars)
