"""A griffe extension for the docs site: the package's reST literal-block markers (``text::``) read as Markdown.

The docstrings show their calls the reST way, a paragraph ending in ``::`` before an indented block.
Markdown already renders the indented block as code; this makes ``text::`` read ``text:`` and drops a
``::`` standing alone on its line, as reST itself does. mkdocs.yml loads it for mkdocstrings' python
handler (``extensions``); the docstrings in the package stay as they are::

    markdown_literals("Run it::\\n\\n    agentkv chat")     # -> "Run it:\\n\\n    agentkv chat"
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_LONE = re.compile(r"^[ \t]*::[ \t]*\n", re.M)
"""A line holding only ``::`` (the literal block's marker after a paragraph that ends otherwise)."""
_TRAILING = re.compile(r"(\S)::[ \t]*$", re.M)
"""``text::`` at a line's end: reST shows it as ``text:``."""


def markdown_literals(text: str) -> str:
    """A docstring's reST literal-block markers as Markdown shows them: ``markdown_literals("See::")`` -> ``See:``."""
    return _TRAILING.sub(r"\1:", _LONE.sub("", text))


class RestLiteralBlocks(griffe.Extension):
    """Rewrites each object's docstring with ``markdown_literals`` as griffe loads it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_literals(obj.docstring.value)
