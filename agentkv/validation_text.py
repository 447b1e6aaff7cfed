"""Pydantic validation errors as one line a user can act on: ``location: message; …``.

::

    describe_problems(error.errors(), root="arguments", show_input=True)
    # "b: Input should be a valid integer (got 'x')"
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MAX_INPUT_REPR_CHARS = 60
"""An offending input is shown up to this many characters."""


def describe_problem(problem: Mapping[str, Any], *, root: str, skip: tuple[str, ...] = (),
                     show_input: bool = False) -> str:
    """One pydantic error as ``location: message`` (``root`` names an empty location; location
    parts in ``skip`` are left out), with ``(got input)`` when ``show_input`` and the input is
    what was wrong (not for a missing or extra field)."""
    location = ".".join(str(part) for part in problem.get("loc", ()) if part not in skip) or root
    text = f"{location}: {problem['msg']}"
    if show_input and problem.get("type") not in ("missing", "extra_forbidden") and "input" in problem:
        shown = repr(problem["input"])
        if len(shown) > MAX_INPUT_REPR_CHARS:
            shown = shown[: MAX_INPUT_REPR_CHARS - 1] + "…"
        text += f" (got {shown})"
    return text


def describe_problems(problems: Iterable[Mapping[str, Any]], *, root: str, skip: tuple[str, ...] = (),
                      show_input: bool = False) -> str:
    """Every problem, ``; ``-separated (see ``describe_problem``)."""
    return "; ".join(describe_problem(p, root=root, skip=skip, show_input=show_input) for p in problems)
