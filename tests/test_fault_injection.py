"""Fault injection: a worker process killed (SIGKILL) at each phase of a turn, then a new
process resumes the session; and random cancel points over a tool loop. Whatever happened,
every committed message is there exactly once, the window renders as a valid message sequence,
the session answers its next message, and the store agrees with itself.

Real SQLite, the scripted model (the phases are timed by its delays, in seconds not minutes).
"""

from __future__ import annotations

import math
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from agentkv import Agent, Runtime
from agentkv.engine.base import common_prefix_len
from agentkv.memory import Store
from agentkv.runtime.persistence import INTERRUPTED_RESULT, load_window
from agentkv.policies.summary_prompt import SUMMARY_PREFIX
from agentkv.run.loop import CANCELLED_RESULT

from _fault_worker import AGENT, FIRST_TURN, LONG_TURN, lookup, scripted_engine

WORKER = str(Path(__file__).with_name("_fault_worker.py"))
PHASES = ["prefill", "decode", "tool", "snapshot", "blocks", "summary"]


async def run_worker_until_ready(phase: str, url: str, conversation_id: str) -> None:
    """Start the worker, wait (≤60 s) for its "ready", kill -9 it."""
    process = await anyio.open_process([sys.executable, WORKER, phase, url, conversation_id], cwd=Path(__file__).parent,
                                       stderr=subprocess.STDOUT)
    try:
        with anyio.fail_after(60):
            line = b""
            async for chunk in process.stdout:
                line += chunk
                if b"\n" in line:
                    break
        if line.split(b"\n")[0].strip() != b"ready":
            with anyio.fail_after(30):
                async for chunk in process.stdout:
                    line += chunk
            raise AssertionError(f"the {phase} worker did not get ready:\n{line.decode(errors='replace')[-3000:]}")
    finally:
        process.send_signal(signal.SIGKILL)
        await process.wait()
        await process.aclose()


def tool_pairs_are_complete(messages) -> bool:
    """Every assistant tool call has exactly one tool result (a valid OpenAI sequence)."""
    results = [m.tool_call_id for m in messages if m.role == "tool"]
    calls = [c.id for m in messages if m.role == "assistant" for c in m.tool_calls]
    return sorted(results) == sorted(calls) and len(set(results)) == len(results)


async def check_store(store: Store, conversation_id: str) -> None:
    rows = await store.messages(conversation_id)
    seqs = [r.seq for r in rows]
    assert seqs == sorted(set(seqs)), seqs  # each message once, in order
    listed = next(s for s in await store.list_conversations() if s.id == conversation_id)
    assert listed.message_count == len(rows)
    assert listed.total_tokens == sum(r.token_count for r in rows) and all(r.token_count > 0 for r in rows)
    assert listed.in_window_tokens == sum(r.token_count for r in rows if r.in_window)


@pytest.mark.parametrize("phase", PHASES)
async def test_a_worker_killed_mid_turn_leaves_a_session_that_resumes_and_answers(phase, tmp_path):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    await run_worker_until_ready(phase, url, "victim")
    store = Store(url)
    runtime = Runtime(scripted_engine(), store, agents=[AGENT])
    session = await runtime.resume("victim")  # the dead worker's lease is taken over at once
    rows = await store.messages("victim")
    users = [r.message.content for r in rows if r.message.role == "user"]
    assert users.count(FIRST_TURN) == 1
    second = {"tool": "please look up the tides", "summary": LONG_TURN, "blocks": LONG_TURN}.get(
        phase, "and another question")
    assert users.count(second) == 1  # committed before the model call, once
    assert tool_pairs_are_complete(session.messages)
    interrupted = [m for m in session.messages if m.role == "tool" and m.content == INTERRUPTED_RESULT]
    assert len(interrupted) == (1 if phase == "tool" else 0)
    assert session.resume_report.interrupted_calls == len(interrupted)
    if phase == "summary":  # append + mark is one transaction: the killed one left neither
        assert not any(r.message.content.startswith(SUMMARY_PREFIX) for r in rows)
        assert not any(r.replaced_by_seq for r in rows) and all(r.in_window for r in rows)
    session.renderer.render([*session.messages], add_generation_prompt=True)  # renders
    if phase == "blocks":  # the first turn's blocks restore; the killed turn's were never named by a row
        first_kv = (await store.snapshots("victim"))[0].num_tokens
        assert session.resume_report.restored_tokens == first_kv > 32
    result = await runtime.run(session, "what next?")
    if phase == "blocks":  # only what the first turn's KV did not hold is prefilled
        assert result.call_metrics[0].prefilled_tokens == result.call_metrics[0].prompt_tokens - first_kv
    assert result.final_text.startswith("Answer number")
    await check_store(store, "victim")
    again = Runtime(scripted_engine(), store, agents=[AGENT])
    resumed = await again.resume("victim")
    assert resumed.resume_report.interrupted_calls == 0  # the repair happened once
    await runtime.aclose()
    await again.aclose()
    await store.close()


LOOPER = Agent(name="looper", instructions="You are a terse assistant. Use lookup for facts.", tools=[lookup])
"""No window policy: the history only grows, so what the KV has read can only grow too."""


async def test_random_cancel_points_over_a_tool_loop_keep_store_and_kv_consistent(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'agentkv.db'}")
    engine = scripted_engine(prefill_s_per_token=0.0002, decode_s_per_token=0.002)
    runtime = Runtime(engine, store, agents=[LOOPER])
    session = await runtime.open_conversation(LOOPER, conversation_id="cancelled")
    started = time.perf_counter()
    await runtime.run(session, "please look up the tides first")  # tool call, result, answer
    full = time.perf_counter() - started
    rng = random.Random(7)
    outcomes = {"cancelled": 0, "finished": 0}
    read_before = 0  # history tokens the KV held before the round
    for round_ in range(20):
        started = time.perf_counter()
        # NOTE: every fourth round runs to its end, so the test sees finished runs (and re-measures a
        # run's length) however loaded the machine is; the others are cut at a random point of it
        bound = rng.uniform(0.05, 1.5) * full if round_ % 4 else math.inf
        with anyio.move_on_after(bound) as scope:
            await runtime.run(session, f"please look up the tides, round {round_}")
        if not scope.cancelled_caught:
            full = time.perf_counter() - started  # runs grow with the history: keep the scale
        outcomes["cancelled" if scope.cancelled_caught else "finished"] += 1
        stored = await load_window(store, session.id)
        assert [e.seq for e in stored] == [e.seq for e in session.window]  # store == memory
        assert tool_pairs_are_complete(session.messages)
        assert all(m.content == CANCELLED_RESULT or m.content.startswith("facts about")
                   for m in session.messages if m.role == "tool")
        rendered = session.render(LOOPER, add_generation_prompt=False).token_ids
        held = common_prefix_len(session.kv.tokens, rendered)
        assert held >= read_before  # a cancel never loses (or corrupts) what the KV had already read
        read_before = held
        assert await store.lease_holder(session.id) is None  # a cancelled run released its lease
    assert outcomes["cancelled"] >= 5 and outcomes["finished"] >= 3, outcomes
    result = await runtime.run(session, "and finally?")
    assert result.final_text.startswith("Answer number")
    await check_store(store, session.id)
    await runtime.aclose()
    await store.close()
