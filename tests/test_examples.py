"""The shipped examples work with the shipped model: the README's quickstart, the guides' snippets,
examples/*.py and ``agentkv chat --tools`` (issue 23, items 19 and 21; issue 48). Code is read from
the README and the guides themselves (``tests/_doc_blocks.py``); every block of them also runs in
``tests/test_docs_code.py``. The tests here run scripted; the real-model ones are in
``tests/model/test_examples_model.py``."""

from __future__ import annotations

import anyio

import agentkv
from _doc_blocks import ROOT, doc_block, run_snippet
from agentkv import Runtime
from agentkv.testing import ScriptedEngine

AGENTS_AND_TOOLS = ROOT / "docs" / "guides" / "agents-and-tools.md"


def readme_block(containing: str) -> str:
    """The README's one ```python block that contains ``containing``."""
    return doc_block(ROOT / "README.md", containing).code


# -- the caller-executed tools snippet -------------------------------------------------------

def run_caller_snippet(runtime: Runtime) -> dict:
    """Run the agents-and-tools guide's caller-executed-tools snippet on ``runtime``; its namespace after."""
    namespace: dict = {name: getattr(agentkv, name) for name in agentkv.__all__ if name != "open_engine"}
    namespace["runtime"] = runtime
    anyio.run(run_snippet, doc_block(AGENTS_AND_TOOLS, "pending_tool_calls"), namespace)
    return namespace


def test_the_caller_tools_snippet_answers_every_pending_call():
    two_calls = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')
    engine = ScriptedEngine([two_calls, "18 C in both."])
    found = run_caller_snippet(Runtime(engine))
    assert found["result"].finish_reason == "stop" and found["result"].final_text == "18 C in both."
    results = [m for m in found["conversation"].messages if m.role == "tool"]
    assert len(results) == 2 and {m.tool_call_id for m in results} == {
        c.id for m in found["conversation"].messages for c in m.tool_calls}
    engine.assert_complete()
