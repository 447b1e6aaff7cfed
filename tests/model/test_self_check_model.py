"""Self-check mode: sampled calls compare the cached path's first-token logits with a fresh
prefill's; results land in the run's result, a fault in the KV is a ``SelfCheckFailed`` event with
the operations since the last check; off by default, and set by argument or environment.

The tests here run the real model; the scripted ones are in ``tests/test_self_check.py``."""

from __future__ import annotations

import pytest

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.observe.self_check import EXACT_TOLERANCE, tolerance_for

pytestmark = pytest.mark.model


async def test_on_the_model_the_cached_path_stays_within_the_tolerance_of_its_numerics(engine):
    runtime = Runtime(engine, self_check=1.0)
    agent = Agent(name="checked-model", instructions="Answer in one short sentence.",
                  generation=GenerationConfig(max_new_tokens=12, temperature=0))
    session = await runtime.open_conversation(agent)
    for question in ("Name a fruit.", "Name a colour.", "Name an animal."):
        result = await runtime.run(session, question)
        [check] = result.self_checks
        assert check.passed, check.describe()
        if tolerance_for(engine) == EXACT_TOLERANCE:
            assert check.argmax_agrees
    await runtime.aclose()


def test_an_engine_compiled_exact_says_so_and_checks_against_the_exact_tolerance(engine, paged_exact):
    assert paged_exact.exact and tolerance_for(paged_exact) == EXACT_TOLERANCE
    assert not engine.exact and tolerance_for(engine) != EXACT_TOLERANCE  # the default KV cache is not f32
