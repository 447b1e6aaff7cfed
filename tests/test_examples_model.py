"""The shipped examples work with the shipped model: the README's snippets, examples/*.py and
``agentkv chat --tools`` (issue 23, items 19 and 21). Code is read from the README itself."""

from __future__ import annotations

import importlib.util
import re
import textwrap
from pathlib import Path

import anyio
import pytest
from typer.testing import CliRunner

import agentkv
from agentkv import Runtime
from agentkv.cli import app
from agentkv.testing import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]


def readme_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
              if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} README blocks contain {containing!r}"
    return blocks[0]


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


# -- the caller-executed tools snippet -------------------------------------------------------

def run_caller_snippet(runtime: Runtime) -> dict:
    """Run the README's caller-executed-tools snippet on ``runtime``; its namespace after."""
    code = readme_block("pending_tool_calls")
    head, tail = code.split("result = await runtime.run(session", 1)
    namespace: dict = {name: getattr(agentkv, name) for name in agentkv.__all__}
    exec(head, namespace)
    body = "async def _snippet(runtime, session):\n" + textwrap.indent(
        "result = await runtime.run(session" + tail, "    ") + "\n    return locals()\n"
    exec(body, namespace)

    async def run():
        session = await runtime.open_session(namespace["agent"])
        return await namespace["_snippet"](runtime, session), session

    found, session = anyio.run(run)
    return {**found, "session": session}


def test_the_caller_tools_snippet_answers_every_pending_call():
    two_calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    engine = ScriptedEngine([two_calls, "18 C in both."])
    found = run_caller_snippet(Runtime(engine))
    assert found["result"].finish_reason == "stop" and found["result"].final_text == "18 C in both."
    results = [m for m in found["session"].messages if m.role == "tool"]
    assert len(results) == 2 and {m.tool_call_id for m in results} == {
        c.id for m in found["session"].messages for c in m.tool_calls}
    engine.assert_complete()


@pytest.mark.model
def test_the_caller_tools_snippet_runs_on_the_default_model(engine):
    found = run_caller_snippet(Runtime(engine))
    messages = found["session"].messages
    first_calls = {c.id for c in messages[1].tool_calls}
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    assert first_calls and first_calls <= answered      # every call of the first step got its result
    assert "<tool" not in found["result"].final_text


# -- tool calls on the default model ---------------------------------------------------------

@pytest.mark.model
def test_the_readme_quickstart_calls_the_calculator_and_shows_391(agentkv_home, capsys):
    exec(readme_block("What is 17 * 23?"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert "→ calculator({'expression': '17 * 23'})" in out and "← 391" in out, out
    assert "<tool" not in out and "354" not in out, out


@pytest.mark.model
def test_the_tool_agent_example_calls_the_calculator(capsys):
    anyio.run(load_example("tool_agent").main)
    out = capsys.readouterr().out
    assert "→ calculator({'expression': '123 * 45'})" in out and "← 5535" in out, out
    assert "<tool" not in out


@pytest.mark.model
def test_chat_with_tools_answers_through_the_calculator_without_looping(tmp_path):
    result = CliRunner().invoke(app, ["chat", "--db", f"sqlite:///{tmp_path / 'a.db'}", "--tools"],
                                input="What is 17 * 23?\n")
    assert result.exit_code == 0, result.output
    assert 'calculator({"expression": "17 * 23"})' in result.output and "← 391" in result.output, result.output
    assert "<tool" not in result.output and "17 * 23 = 17 * 23" not in result.output


# -- the resume example --------------------------------------------------------------------

@pytest.mark.model
def test_the_resume_example_resumes_its_session_from_the_snapshot(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    example = load_example("resume")
    anyio.run(example.main)
    first = capsys.readouterr().out
    anyio.run(example.main)
    second = capsys.readouterr().out
    assert "Paris" in first, first
    restored = int(second.split("messages; ")[1].split()[0])
    assert restored > 0 and "Eiffel Tower" in second, second
