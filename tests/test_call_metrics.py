"""A model call's decode figures — tokens a grammar forced, tokens drafts proposed and the model
accepted, model steps saved — reach its OpenTelemetry span, its stored call record (schema 9),
the session's totals and ``agentkv conversations show ID --kv``; a database from before schema 9
upgrades keeping its calls (their figures NULL: not recorded), and older code refuses a schema 9
database."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
from rich.console import Console
from sqlalchemy import create_engine, text
from typer.testing import CliRunner

from _old_schema import schema_at

from agentkv import Agent, Runtime
from agentkv.cli.app import app
from agentkv.cli.display import TurnPrinter, decode_figures
from agentkv.engine.generation import GenerationMetrics, GenerationResult, TokenDelta
from agentkv.errors import SchemaVersionError
from agentkv.events import ModelCallFinished
from agentkv.memory import Store
from agentkv.memory import migrations
from agentkv.memory.migrations import MIGRATIONS
from agentkv.memory.schema import utcnow
from agentkv.memory.conversation_stats import CallDecode, ConversationStats, conversation_stats
from agentkv.testing import ScriptedEngine
from agentkv.testing.session import ScriptedSession

FIGURES = [  # (forced, drafted, accepted, steps saved) of each scripted call, in order
    (24, 0, 0, 20),
    (0, 16, 12, 10),
]


class MeasuredSession(ScriptedSession):
    """A scripted session whose results carry the next decode figures of ``FIGURES``."""

    async def _generate_events(self, *args, **kwargs) -> AsyncIterator[TokenDelta | GenerationResult]:
        async for event in super()._generate_events(*args, **kwargs):
            if isinstance(event, GenerationResult):
                engine = self._backend.script  # the ScriptedEngine: its calls so far, this one last
                forced, drafted, accepted, saved = FIGURES[len(engine.calls) - 1]
                metrics = dataclasses.replace(event.metrics, forced_tokens=forced, drafted_tokens=drafted,
                                              accepted_tokens=accepted, steps_saved=saved)
                event = dataclasses.replace(event, metrics=metrics)
            yield event


class MeasuredEngine(ScriptedEngine):
    session_class = MeasuredSession


async def two_measured_calls(db: str) -> str:
    runtime = Runtime(MeasuredEngine(["word " * 30, "done " * 20]), Store(db))
    session = await runtime.open_conversation(Agent(name="measured", instructions="Be brief."))
    for text_in in ("First?", "Second?"):
        await runtime.run(session, text_in)
    return session.id


async def test_decode_figures_of_each_call_are_stored_and_summed(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    conversation_id = await two_measured_calls(db)
    store = Store(db)
    calls = await store.calls(conversation_id)
    assert [(c.forced_tokens, c.drafted_tokens, c.accepted_tokens, c.steps_saved) for c in calls] == FIGURES
    stats = await conversation_stats(store, conversation_id)
    assert (stats.forced_tokens, stats.drafted_tokens, stats.accepted_tokens, stats.steps_saved) == (24, 16, 12, 30)
    assert [d.number for d in stats.decode] == [1, 2]
    await store.close()


def test_sessions_show_kv_prints_decode_totals_and_each_calls_figures(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    conversation_id = anyio.run(two_measured_calls, db)
    first, second = (c.generated_tokens for c in anyio.run(Store(db).calls, conversation_id))
    result = CliRunner().invoke(app, ["conversations", "show", conversation_id, "--kv", "--db", db],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    assert (f"decode: 24 of {first + second} generated tokens forced, 16 drafted, 12 accepted (75%); "
            "30 model steps saved\n") in result.output
    assert f"  call 1: generated {first}, forced 24, drafted 0, accepted 0, 20 steps saved\n" in result.output
    assert f"  call 2: generated {second}, forced 0, drafted 16, accepted 12, 10 steps saved\n" in result.output


async def test_a_model_calls_span_carries_its_decode_figures():
    sdk = pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from agentkv.observe import tracing

    exporter = InMemorySpanExporter()
    provider = sdk.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_tracer_provider(provider)
    try:
        runtime = Runtime(MeasuredEngine(["word " * 30]))
        await runtime.run(await runtime.open_conversation(Agent(name="traced")), "Hi")
    finally:
        tracing.use_tracer_provider(None)
    [span] = [s for s in exporter.get_finished_spans() if s.name == "agentkv.model_call"]
    figures = {k: span.attributes[k] for k in ("forced_tokens", "drafted_tokens", "accepted_tokens", "steps_saved")}
    assert figures == dict(zip(figures, FIGURES[0]))


def test_session_totals_count_only_calls_that_recorded_figures_and_say_how_many_did():
    stats = ConversationStats(conversation_id="s", window_tokens=0, kv_tokens=0, kv_bytes=0, snapshots=(), calls=4,
                              reused_tokens=0, prefilled_tokens=0, generated_tokens=97, prefill_s_per_token=0.0,
                              compactions=0, cache_breaks=(),
                              decode=(CallDecode(2, generated=40, forced=24, steps_saved=20),
                                      CallDecode(3, generated=20, drafted=10, accepted=5, steps_saved=5),
                                      CallDecode(4, generated=7)))
    [total, *calls] = [line for line in stats.lines() if "forced" in line]
    assert total == ("decode: 24 of 67 generated tokens forced, 10 drafted, 5 accepted (50%); 25 model steps saved "
                     "(3 of 4 calls recorded these)")
    assert calls == ["  call 2: generated 40, forced 24, drafted 0, accepted 0, 20 steps saved",
                     "  call 3: generated 20, forced 0, drafted 10, accepted 5, 5 steps saved"]  # not call 4: nothing


def test_a_session_without_recorded_figures_prints_no_decode_line():
    stats = ConversationStats(conversation_id="s", window_tokens=0, kv_tokens=0, kv_bytes=0, snapshots=(), calls=2,
                              reused_tokens=0, prefilled_tokens=0, generated_tokens=9, prefill_s_per_token=0.0,
                              compactions=0, cache_breaks=())
    assert stats.steps_saved == 0 and not any(line.startswith("decode") for line in stats.lines())


def test_the_chat_metrics_line_adds_decode_figures_only_when_there_are_some():
    plain = GenerationMetrics(prompt_tokens=9, reused_tokens=0, prefix_cache_tokens=0, restored_tokens=0,
                              prefilled_tokens=9, generated_tokens=40, ttft_s=0.1, tpot_s=0.02, kv_tokens=49,
                              kv_bytes=4096)
    assert decode_figures(plain) == ""
    measured = dataclasses.replace(plain, forced_tokens=24, drafted_tokens=10, accepted_tokens=8, steps_saved=26)
    assert decode_figures(measured) == " (forced 24, drafted 10, accepted 8, 26 steps saved)"
    err = Console(record=True, width=200)
    printer = TurnPrinter(Console(record=True), err, metrics=True, eos_token_id=0, max_new_tokens=64)
    printer.show(ModelCallFinished(0, measured))
    assert "generated 40 (forced 24, drafted 10, accepted 8, 26 steps saved), TTFT 100 ms" in err.export_text()


# -- schema 9 --------------------------------------------------------------------------------

def _database_at(store_url: str, version: int) -> None:
    """Build the schema as it was at ``version``, with one stored call."""
    engine = create_engine(store_url)
    now = utcnow().replace(tzinfo=None)
    with engine.begin() as conn:
        schema_at(conn, version)
        conn.execute(text("INSERT INTO agents (name, instructions, tool_names, settings, updated_at) "
                          "VALUES ('old', 'Be kind.', '[]', '{}', :now)"), {"now": now})
        conn.execute(text("INSERT INTO sessions (id, agent_name, created_at, updated_at, metadata) "
                          "VALUES ('s1', 'old', :now, :now, '{}')"), {"now": now})
        conn.execute(text(
            "INSERT INTO calls (session_id, prompt_tokens, reused_tokens, prefix_cache_tokens, prefilled_tokens, "
            "generated_tokens, ttft_s, tpot_s, kv_tokens, kv_bytes, created_at) "
            "VALUES ('s1', 100, 60, 10, 30, 12, 0.25, 0.02, 112, 4096, :now)"), {"now": now})
    engine.dispose()


async def test_calls_stored_before_schema_9_keep_every_figure_and_read_as_not_recorded(store_url: str,
                                                                                       tmp_path: Path):
    _database_at(store_url, 8)
    store = Store(store_url, snapshot_dir=tmp_path / "s")
    [old] = await store.calls("s1")
    assert (old.prompt_tokens, old.reused_tokens, old.prefix_cache_tokens, old.prefilled_tokens,
            old.generated_tokens, old.ttft_s, old.tpot_s, old.kv_tokens, old.kv_bytes) == (
        100, 60, 10, 30, 12, 0.25, 0.02, 112, 4096)
    assert (old.forced_tokens, old.drafted_tokens, old.accepted_tokens, old.steps_saved) == (None,) * 4
    await store.record_call(dataclasses.replace(old, id=0, created_at=None, forced_tokens=5, drafted_tokens=4,
                                                accepted_tokens=3, steps_saved=6))
    stats = await conversation_stats(store, "s1")
    assert stats.calls == 2 and [d.number for d in stats.decode] == [2]
    assert (stats.forced_tokens, stats.drafted_tokens, stats.accepted_tokens, stats.steps_saved) == (5, 4, 3, 6)
    await store.close()


async def test_code_that_knows_only_schema_8_refuses_a_schema_9_database(store_url: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    _database_at(store_url, 9)
    monkeypatch.setattr(migrations, "MIGRATIONS", MIGRATIONS[:8])
    monkeypatch.setattr(migrations, "LATEST_VERSION", 8)
    older = Store(store_url, snapshot_dir=tmp_path / "s")
    with pytest.raises(SchemaVersionError, match="schema version 9, newer than 8 .* upgrade agentkv"):
        await older.list_conversations()
    await older.close()
