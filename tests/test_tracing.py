"""OpenTelemetry spans, caught by the in-memory exporter: a run, its model calls (with the token
counts, timings, KV size and cache break), tool calls, a compaction and snapshot saves and
restores, each with the session id; without opentelemetry every span is a no-op."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentkv import Agent, Runtime, tool
from agentkv.observe import tracing
from agentkv.memory import Store
from agentkv.policies import Truncation
from agentkv.testing import ScriptedEngine

sdk = pytest.importorskip("opentelemetry.sdk.trace")
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture
def spans():
    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    yield exporter
    tracing.use_tracer_provider(None)


async def test_a_run_its_model_and_tool_calls_a_compaction_and_snapshots_are_spans(spans, tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    agent = Agent(name="traced", instructions="Be brief.", tools=[add], policy=Truncation(), max_prompt_len=300,
                  min_response_len=16)
    runtime = Runtime(ScriptedEngine([call("add", a=2, b=3), "It is 5.", "word " * 60, "Done."]), Store(db))
    session = await runtime.open_conversation(agent)
    await runtime.run(session, "What is 2+3?")
    await runtime.run(session, "Talk " * 80)
    await runtime.run(session, "More " * 60)
    finished = {s.name: s for s in spans.get_finished_spans()}
    names = [s.name for s in spans.get_finished_spans()]
    assert {"agentkv.run", "agentkv.model_call", "agentkv.tool_call", "agentkv.snapshot.save",
            "agentkv.compaction"} <= set(names)
    runs = [s for s in spans.get_finished_spans() if s.name == "agentkv.run"]
    model = [s for s in spans.get_finished_spans() if s.name == "agentkv.model_call"]
    assert len(runs) == 3 and len(model) == 4
    assert all(s.parent is not None and s.parent.span_id in {r.context.span_id for r in runs} for s in model)
    first = model[0].attributes
    for key in ("prompt_tokens", "reused_tokens", "prefix_cache_tokens", "prefilled_tokens", "generated_tokens",
                "ttft_s", "tpot_s", "kv_bytes"):
        assert key in first
    assert finished["agentkv.tool_call"].attributes["tool"] == "add"
    assert all(s.attributes.get("conversation_id") == session.id for s in spans.get_finished_spans()
               if s.name != "agentkv.tool_call" and s.name != "agentkv.compaction")
    assert any("cache_break_cause" in s.attributes for s in model)  # the compaction broke the cache
    later = Runtime(ScriptedEngine(["Again."]), Store(db), agents=[agent])
    await later.resume(session.id)
    assert "agentkv.snapshot.restore" in [s.name for s in spans.get_finished_spans()]


async def test_a_failed_run_marks_its_span(spans):
    runtime = Runtime(ScriptedEngine([RuntimeError("the model crashed")]))
    session = await runtime.open_conversation(Agent(name="fails"))
    with pytest.raises(RuntimeError):
        await runtime.run(session, "Hi")
    [run] = [s for s in spans.get_finished_spans() if s.name == "agentkv.run"]
    assert not run.status.is_ok


async def test_without_opentelemetry_spans_are_no_ops(monkeypatch):
    monkeypatch.setattr(tracing, "_trace", None)
    assert not tracing.enabled()
    runtime = Runtime(ScriptedEngine(["Hello."]))
    session = await runtime.open_conversation(Agent(name="quiet"))
    assert (await runtime.run(session, "Hi")).final_text == "Hello."
    assert tracing.start("x") is tracing.NO_SPAN
