"""Self-check mode: sampled calls compare the cached path's first-token logits with a fresh
prefill's; results land in the run's result, a fault in the KV is a ``SelfCheckFailed`` event with
the operations since the last check; off by default, and set by argument or environment."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agentkv import Agent, Runtime
from agentkv.errors import UserError
from agentkv.events import SelfCheckFailed
from agentkv.observe.self_check import DEFAULT_TOLERANCE, EXACT_TOLERANCE, fraction_from, tolerance_for
from agentkv.testing import ScriptedEngine
from agentkv.testing.fake_kv import fake_keys

AGENT = Agent(name="checked", instructions="Be brief.")


async def test_every_checked_call_agrees_with_a_fresh_prefill_when_the_kv_is_sound():
    runtime = Runtime(ScriptedEngine(["One.", "Two.", "Three.", "Four."]), self_check=1.0)
    session = await runtime.open_conversation(AGENT)
    for question in ("A?", "B?", "C?"):
        result = await runtime.run(session, question)
        [check] = result.self_checks
        assert check.passed and check.max_abs_diff == 0.0 and check.argmax_agrees
        assert check.prompt_tokens == result.call_metrics[0].prompt_tokens and check.cost_s > 0
    held = len(session.kv.tokens)  # the checks left the session's own KV as it was: the next call reuses it
    assert (await runtime.run(session, "D?")).call_metrics[0].reused_tokens >= held - 1


async def test_a_corrupted_kv_is_caught_with_the_operations_since_the_last_check():
    runtime = Runtime(ScriptedEngine(["One.", "Two."]), self_check=1.0)
    session = await runtime.open_conversation(AGENT)
    await runtime.run(session, "A?")
    snapshot = await session.kv.snapshot()
    # a silent fault: consistent KV of *other* tokens under this session's token log
    others = snapshot.values[0, 0, 0, :, 0].astype(np.int64) + 3
    values = snapshot.values.copy()
    values[0, 0, 0, :, 0] = others
    keys = fake_keys(others.tolist(), 0)[None, None, None]
    await session.kv.restore(dataclasses.replace(snapshot, keys=keys, values=values))
    events = [event async for event in runtime.run_stream(session, "B?")]
    [failed] = [e for e in events if isinstance(e, SelfCheckFailed)]
    assert failed.conversation_id == session.id and not failed.result.passed
    assert any(op.startswith("call 0") for op in failed.operations)
    assert events[-1].result.self_checks == (failed.result,)


async def test_self_check_is_off_by_default_and_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("AGENTKV_SELF_CHECK", raising=False)
    runtime = Runtime(ScriptedEngine(["One."]))
    session = await runtime.open_conversation(AGENT)
    assert (await runtime.run(session, "A?")).self_checks == ()
    monkeypatch.setenv("AGENTKV_SELF_CHECK", "0.25")
    assert fraction_from(None) == 0.25
    monkeypatch.setenv("AGENTKV_SELF_CHECK", "often")
    with pytest.raises(UserError, match="AGENTKV_SELF_CHECK"):
        fraction_from(None)
    with pytest.raises(UserError, match="between 0 and 1"):
        Runtime(ScriptedEngine([]), self_check=2.0)




def test_the_tolerance_follows_whether_the_engine_says_its_numerics_are_exact():
    assert tolerance_for(ScriptedEngine(exact=True)) == EXACT_TOLERANCE
    assert tolerance_for(ScriptedEngine()) == DEFAULT_TOLERANCE
