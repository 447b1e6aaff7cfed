"""Each model call of a stored conversation is kept (calls table) and summed up: reuse against
prefill and the time it saved, KV size, snapshots, compactions and cache breaks — what
``agentkv conversations show ID --kv`` prints."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
from typer.testing import CliRunner

from agentkv import Agent, Runtime
from agentkv.cli.app import app
from agentkv.memory import Store
from agentkv.policies import Truncation
from agentkv.memory.conversation_stats import conversation_stats
from agentkv.testing import ScriptedEngine

AGENT = Agent(name="stats", instructions="Be brief.", policy=Truncation(), max_prompt_len=80, min_response_len=16)


async def three_turns(db: str) -> tuple[str, list]:
    store = Store(db)
    runtime = Runtime(ScriptedEngine(["word " * 20, "word " * 20, "Short.", "Fine."]), store)
    session = await runtime.open_conversation(AGENT)
    results = [await runtime.run(session, text) for text in ("First " * 10, "Second " * 10, "Third?")]
    session.agent = dataclasses.replace(AGENT, instructions="Be very brief.", policy=None, max_prompt_len=None)
    results.append(await runtime.run(session, "Fourth?"))  # no compaction now: the new instructions break it
    return session.id, results


async def test_every_call_is_kept_and_the_figures_add_up(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    conversation_id, results = await three_turns(db)
    store = Store(db)
    calls = await store.calls(conversation_id)
    assert len(calls) == 4
    assert [c.prefilled_tokens for c in calls] == [r.call_metrics[0].prefilled_tokens for r in results]
    assert calls[1].compaction["policy"] and calls[1].cache_break["cause"] == "window compaction"
    assert calls[3].cache_break["cause"] == "instructions changed"
    stats = await conversation_stats(store, conversation_id)
    assert stats.calls == 4 and stats.compactions >= 1 and len(stats.cache_breaks) >= 2
    assert stats.reused_tokens == sum(m.reused_tokens + m.prefix_cache_tokens for r in results for m in r.call_metrics)
    assert stats.saved_s >= 0 and stats.kv_tokens == results[-1].call_metrics[-1].kv_tokens
    assert stats.snapshots and stats.window_tokens > 0


def test_sessions_show_kv_prints_the_figures(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    conversation_id, _ = anyio.run(three_turns, db)
    result = CliRunner().invoke(app, ["conversations", "show", conversation_id, "--kv", "--db", db],
                                env={"COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    for fragment in ("4 model calls", "reuse saved", "cache breaks", "cause: window compaction",
                     "cause: instructions changed", "snapshot "):
        assert fragment in result.output
