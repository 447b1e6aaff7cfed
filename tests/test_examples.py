"""The shipped examples work with the shipped model: the README's snippets, examples/*.py and
``agentkv chat --tools`` (issue 23, items 19 and 21). Code is read from the README itself."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import anyio

import agentkv
from agentkv import Runtime
from agentkv.testing import ScriptedEngine

ROOT = Path(__file__).resolve().parents[1]


def readme_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    blocks = [b for b in re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
              if containing in b]
    assert len(blocks) == 1, f"{len(blocks)} README blocks contain {containing!r}"
    return blocks[0]


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
        session = await runtime.open_conversation(namespace["agent"])
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


# -- tool calls on the default model ---------------------------------------------------------


# -- the resume example --------------------------------------------------------------------

