"""The shipped examples work with the shipped model: the README's quickstart, the guides' caller-tools
snippet, examples/*.py and ``agentkv chat --tools`` (issue 23, items 19 and 21). Code is read from the
README and the guides themselves.

The tests here run the real model; the scripted ones are in ``tests/test_examples.py``."""

from __future__ import annotations

import importlib.util

import anyio
import pytest
from test_examples import ROOT, readme_block, run_caller_snippet
from typer.testing import CliRunner

from agentkv import Runtime
from agentkv.cli.app import app

pytestmark = pytest.mark.model


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def agentkv_home(tmp_path, monkeypatch):
    monkeypatch.delenv("AGENTKV_DB_URL", raising=False)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_the_caller_tools_snippet_runs_on_the_default_model(engine):
    found = run_caller_snippet(Runtime(engine))
    messages = found["conversation"].messages
    first_calls = {c.id for c in messages[1].tool_calls}
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    assert first_calls and first_calls <= answered      # every call of the first model call got its result
    assert "<tool" not in found["result"].final_text


def test_the_readme_quickstart_calls_the_calculator_and_shows_391(agentkv_home, capsys):
    exec(readme_block("What is 17 * 23?"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "→ calculator({'expression': '17 * 23'})" in out and "← 391" in out, out
    assert "<tool" not in out and "354" not in out, out


def test_the_tool_agent_example_calls_the_calculator(capsys):
    anyio.run(load_example("tool_agent").main)
    out = capsys.readouterr().out
    assert "→ calculator({'expression': '123 * 45'})" in out and "← 5535" in out, out
    assert "<tool" not in out


def test_chat_with_tools_answers_through_the_calculator_without_looping(tmp_path):
    result = CliRunner().invoke(app, ["chat", "--db", f"sqlite:///{tmp_path / 'a.db'}", "--tools"],
                                input="What is 17 * 23?\n")
    assert result.exit_code == 0, result.output
    assert 'calculator({"expression": "17 * 23"})' in result.output and "← 391" in result.output, result.output
    assert "<tool" not in result.output and "17 * 23 = 17 * 23" not in result.output


def test_the_resume_example_resumes_its_conversation_from_the_snapshot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    example = load_example("resume")
    anyio.run(example.main)
    first = capsys.readouterr().out
    anyio.run(example.main)
    second = capsys.readouterr().out
    assert "Paris" in first, first
    restored = int(second.split("messages; ")[1].split()[0])
    assert restored > 0 and "Eiffel Tower" in second, second
