"""Every ``--help`` of the CLI, read as a new user reads it: each command, option and argument says
something, and no text reads like an internal note (module paths, Python API names, reST markup,
typer's type names for a value, a default given as a bare status code)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from agentkv.cli.app import app

INTERNAL = {
    "a default as a bare number, no unit or meaning, e.g. (default: 413)": re.compile(r"\(default: \d+\)"),
    "reST markup": re.compile(r"``"),
    "a module path": re.compile(r"\bagentkv\.(cli|engine|chat|memory|runtime|server|run|kv|policies|tools)\b"),
    "a Python function name": re.compile(r"\b(open_engine|runtime\.approve|runtime\.reject|describe)\b"),
    "typer's type name for an option's value": re.compile(r"--[a-z-]+ <(str|int range|float range|int|float|path)>"),
}


def commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Each command and subcommand, with the words that call it (typer 0.29 builds on its own copy
    of click: groups are known by their ``commands``)."""
    yield path, command
    for name, sub in (getattr(command, "commands", None) or {}).items():
        yield from commands(sub, (*path, name))


ALL = list(commands(typer.main.get_command(app)))


def test_the_walk_finds_every_command():
    names = {" ".join(path) for path, _ in ALL}
    assert {"chat", "resume", "serve", "conversations list", "conversations unlock", "models info",
            "models prune"} <= names


@pytest.mark.parametrize(("path", "command"), ALL, ids=[" ".join(p) or "agentkv" for p, _ in ALL])
def test_every_help_explains_and_reads_like_no_internal_note(path, command):
    result = CliRunner().invoke(app, [*path, "--help"], env={"COLUMNS": "100"})
    assert result.exit_code == 0, result.output
    assert (command.help or "").strip(), f"agentkv {' '.join(path)} has no help text"
    params = [p for p in command.params if p.name != "help" and not getattr(p, "hidden", False)]
    for param in params:
        assert (getattr(param, "help", None) or "").strip(), f"{param.name} of agentkv {' '.join(path)} has no help"
        if param.param_type_name == "option" and not param.is_flag and not param.type_descriptor.is_choice:
            assert param.metavar, (f"{param.opts[0]} of agentkv {' '.join(path)} shows typer's type name: "
                                   "give it a metavar (e.g. TOKENS, URL)")
    for what, pattern in INTERNAL.items():
        found = pattern.search(result.output)
        assert found is None, f"agentkv {' '.join(path)} --help holds {what}: {found.group(0) if found else ''}"


def test_serve_policy_help_says_what_happens_without_one():
    result = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "100"})
    text = " ".join(result.output.split())
    assert "(default: 413)" not in text
    assert "Without one, a request that no longer fits is refused with HTTP 413" in text
