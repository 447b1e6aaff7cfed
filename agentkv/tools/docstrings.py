"""Read a tool's docstring: its summary paragraph and its argument descriptions (Google, NumPy or Sphinx style).

::

    doc = parse_docstring('''Add two numbers.

        Args:
            a: The first number.
            b (int): The second number,
                which may be negative.
        ''')
    doc.summary            # "Add two numbers."
    doc.arguments["b"]     # "The second number, which may be negative."

griffe parses the sections; styles are tried in the order of ``STYLES`` and the first that
describes any argument wins.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass, field

from griffe import Docstring, DocstringSection, DocstringSectionKind, DocstringStyle

STYLES: tuple[DocstringStyle, ...] = ("google", "numpy", "sphinx")
"""Docstring styles tried in turn for argument descriptions."""

_ARGUMENT_KINDS = (DocstringSectionKind.parameters, DocstringSectionKind.other_parameters)
_HEADER = r"[A-Za-z][A-Za-z ]*:"
_LEADING_HEADER = re.compile(rf"^{_HEADER}\n(?=\S)")
_HEADER_UNDER_TEXT = re.compile(rf"^(.+\n)(?={_HEADER}$)", re.MULTILINE)


@dataclass(frozen=True)
class ParsedDocstring:
    """What a docstring says about a tool."""

    summary: str
    """The first paragraph, its lines joined by single spaces ("" without a docstring)."""
    arguments: dict[str, str] = field(default_factory=dict)
    """Argument name → description, from the ``Args:`` (or ``Parameters``, ``:param``) section."""


def parse_docstring(docstring: str | None) -> ParsedDocstring:
    """Split a docstring into its summary paragraph and its argument descriptions."""
    if not docstring:
        return ParsedDocstring(summary="")
    text = _laid_out(inspect.cleandoc(docstring))
    # NOTE: the leading newline stops griffe's own cleandoc from dedenting a leading section.
    parses = [Docstring("\n" + text).parse(style, warnings=False) for style in STYLES]
    arguments = next((found for found in map(_arguments, parses) if found), {})
    return ParsedDocstring(summary=_summary(parses[0]), arguments=arguments)


def _summary(sections: list[DocstringSection]) -> str:
    """The first paragraph of the opening text; "" when the docstring opens with a section."""
    if not sections or sections[0].kind is not DocstringSectionKind.text:
        return ""
    return " ".join(sections[0].value.split("\n\n")[0].split())


def _arguments(sections: list[DocstringSection]) -> dict[str, str]:
    """Argument name → description (lines joined by single spaces) from parsed sections."""
    return {
        parameter.name.lstrip("*"): " ".join(parameter.description.split())
        for section in sections if section.kind in _ARGUMENT_KINDS
        for parameter in section.value
    }


def _laid_out(text: str) -> str:
    """Two layouts griffe does not read as a section, rewritten so that it does.

    A header straight under a text line (``"Sum.\\nArgs:"``) gets the blank line griffe needs.
    A docstring opening with a header whose entries lost their indent to ``inspect.cleandoc``
    (``"Args:\\n        x: ..."`` comes out as ``"Args:\\nx: ..."``) gets it back.
    """
    text = _HEADER_UNDER_TEXT.sub(r"\1\n", text)
    if not _LEADING_HEADER.match(text):
        return text
    first, rest = text.split("\n", 1)
    return first + "\n" + "\n".join(f"    {line}" if line else line for line in rest.splitlines())
