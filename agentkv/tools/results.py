"""Turn what a tool returned into the text the model reads, capped to a size.

::

    serialize_result({"temp": 21.5})              # '{"temp": 21.5}'
    truncate_text("x" * 10, max_chars=4)          # 'xxxx…[truncated 6 chars]'
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python


def serialize_result(result: Any) -> str:
    """Text for the model: ``str`` as is, pydantic models as their JSON, anything else as JSON.

    ``None`` becomes ``""``. Values JSON cannot hold (datetimes, dataclasses, sets, ...) go through
    pydantic's JSON conversion, and as a last resort ``str()``.
    """
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    if isinstance(result, BaseModel):
        return result.model_dump_json()
    return json.dumps(result, ensure_ascii=False, default=_jsonable)


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
