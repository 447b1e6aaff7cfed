"""Read a tool's docstring: its summary paragraph and the Google-style ``Args:`` descriptions.

::

    doc = parse_docstring('''Add two numbers.

        Args:
            a: The first number.
            b (int): The second number,
                which may be negative.
        ''')
    doc.summary            # "Add two numbers."
    doc.arguments["b"]     # "The second number, which may be negative."
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

ARGUMENT_SECTIONS = frozenset({"args", "arguments", "parameters", "params"})
"""Section headers (lower-cased, without the colon) whose entries describe arguments."""

_SECTION_HEADER = re.compile(r"^([A-Za-z][A-Za-z ]*):\s*$")
_ARGUMENT_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


@dataclass(frozen=True)
class ParsedDocstring:
    """What a docstring says about a tool."""

    summary: str
    """The first paragraph, its lines joined by single spaces ("" without a docstring)."""
    arguments: dict[str, str] = field(default_factory=dict)
    """Argument name → description, from the ``Args:`` section."""


def parse_docstring(docstring: str | None) -> ParsedDocstring:
    """Split a docstring into its summary paragraph and its argument descriptions."""
    if not docstring:
        return ParsedDocstring(summary="")
    lines = inspect.cleandoc(docstring).splitlines()
    return ParsedDocstring(summary=_summary(lines), arguments=_argument_descriptions(lines))


def _summary(lines: list[str]) -> str:
    """The first paragraph, unless the docstring opens with a section such as ``Args:``."""
    paragraph: list[str] = []
    for line in lines:
        stripped = line.strip()
        if not stripped or (_SECTION_HEADER.match(stripped) and not line[:1].isspace()):
            break
        paragraph.append(stripped)
    return " ".join(paragraph)


def _argument_descriptions(lines: list[str]) -> dict[str, str]:
    """Entries of every ``Args:``-like section; continuation lines join the entry above."""
    descriptions: dict[str, str] = {}
    in_section = False
    header_indent = 0
    entry_indent: int | None = None
    current: str | None = None
    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        header = _SECTION_HEADER.match(stripped)
        if header and (not in_section or indent <= header_indent):
            in_section = header.group(1).strip().lower() in ARGUMENT_SECTIONS
            header_indent, entry_indent, current = indent, None, None
            continue
        if not in_section or not stripped:
            continue
        if entry_indent is None:
            entry_indent = indent
        elif indent < entry_indent:
            in_section, current = False, None
            continue
        entry = _ARGUMENT_ENTRY.match(stripped) if indent <= entry_indent else None
        if entry:
            current = entry.group(1)
            descriptions[current] = entry.group(2).strip()
        elif current is not None:
            descriptions[current] = f"{descriptions[current]} {stripped}".strip()
    return descriptions
