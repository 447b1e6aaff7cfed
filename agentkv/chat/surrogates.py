"""Lone surrogates in text replaced by U+FFFD, so every message can be encoded as UTF-8.

Undecodable bytes read with ``errors="surrogateescape"`` (``sys.stdin``, ``os.fsdecode``) become
lone surrogates (``"\\udcff"``), and a JSON ``"\\ud800"`` escape parses into one; UTF-8 refuses
them, so rendering, hashing and storing such text would fail. They are replaced, as
``bytes.decode(errors="replace")`` would have::

    replace_lone_surrogates("caf\\udcc3\\udca9 ok")   # 'caf\\ufffd\\ufffd ok'
    replace_lone_surrogates({"q": ["\\ud800"]})       # {'q': ['\\ufffd']}
"""

from __future__ import annotations

import re
from typing import Any

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
REPLACEMENT = "\ufffd"


def replace_lone_surrogates(value: Any) -> Any:
    """``value`` with every lone surrogate in its strings (dict keys and values, list and tuple
    items, nested) replaced by U+FFFD; anything else is returned as it is."""
    if isinstance(value, str):
        return _LONE_SURROGATE.sub(REPLACEMENT, value) if _has_surrogate(value) else value
    if isinstance(value, dict):
        return {replace_lone_surrogates(k): replace_lone_surrogates(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(replace_lone_surrogates(v) for v in value)
    return value


def _has_surrogate(text: str) -> bool:
    """True when ``text`` cannot be encoded as UTF-8 (the fast path: encode succeeds)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return True
    return False
