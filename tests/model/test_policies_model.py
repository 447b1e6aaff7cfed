"""Context-window policies: invariants on random scripted conversations, each policy's mechanics,
oversized messages, and each policy on the real model crossing the limit several times.

The tests here run the real model; the scripted ones are in ``tests/test_policies.py``."""

from __future__ import annotations

import pytest
from test_policies import POLICIES

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.engine.base import common_prefix_len
from agentkv.events import ContextCompacted, ModelCallFinished
from agentkv.policies import (
    SUMMARY_PREFIX,
)
from agentkv.run.conversation import WindowEntry

pytestmark = pytest.mark.model


QUESTIONS = [
    "I am planning a trip to Lisbon in May. What should I pack for the weather there?",
    "My sister is coming too; she loves old churches and tiled buildings. Any suggestions?",
    "We will stay five days. Is it worth taking a day trip to Sintra, and how do we get there?",
    "What local dishes should we try, especially anything with fish or custard tarts?",
    "How expensive is public transport, and should we buy a travel card on arrival?",
    "Are there good viewpoints in the city for watching the sunset in the evening?",
    "Remind me which things you told me to pack, and which dishes to try first.",
]
"""Seven turns in a 192-token window with 16-token answers: every policy compacts during the 4th
and the 6th (measured: truncation and sliding_window remove 8 entries by then, summarize 11); the
7th is slack for a CPU whose answers run longer or shorter. Longer windows and answers (320, 28)
took nine turns for the same two compactions (truncation), at twice the CPU time."""


@pytest.fixture(scope="session")
def policy_engine():
    """The default engine settings (this CPU's numerics), two slots (the conversation and the
    summariser)."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=2)


@pytest.mark.parametrize("policy_name", list(POLICIES))
async def test_each_policy_carries_a_real_conversation_across_the_limit_several_times(
    policy_engine, policy_name
):
    options = {"max_summary_tokens": 40, "chunk_tokens": 256} if policy_name == "summarize" else {}
    agent = Agent(
        name=f"real-{policy_name}",
        instructions="You are a concise travel assistant.",
        policy=POLICIES[policy_name](**options),
        max_prompt_len=192,
        min_response_len=32,
        generation=GenerationConfig(max_new_tokens=16),
    )
    runtime = Runtime(policy_engine)
    session = await runtime.open_conversation(agent)
    removed: list[WindowEntry] = []

    async def hook(session, gone, replacement):
        removed.extend(gone)

    session.on_window_change = hook
    events, prompts, after_compaction = [], [], []
    try:
        for question in QUESTIONS:
            compacted = False
            async for event in runtime.run_stream(session, question):
                if isinstance(event, ContextCompacted):
                    events.append(event)
                    compacted = True
                    if event.policy == "sliding_window":
                        kv_tokens = session.kv.tokens
                        rendered = session.render(agent).token_ids
                        assert common_prefix_len(kv_tokens, rendered) == len(kv_tokens)
                elif isinstance(event, ModelCallFinished):
                    prompts.append(event.metrics.prompt_tokens)
                    if compacted:
                        new_turn = len(policy_engine.tokenizer.encode(question))
                        after_compaction.append((event.metrics.prefilled_tokens, new_turn))
                        compacted = False
        shifted = session.kv.shifted  # read before close: a closed session's log is empty
    finally:
        await runtime.aclose()
    assert len(events) >= 2
    assert max(prompts) <= 192 - 32
    assert all(e.policy == POLICIES[policy_name].name for e in events)
    if policy_name != "summarize":  # a summary of a weak model may come back empty: its fallback is tested above
        assert all(e.fallback is None for e in events), [e.fallback_reason for e in events]
    if policy_name == "sliding_window":  # real shifts: the next call prefills the new turn only
        assert all(prefilled <= new_turn + 12 for prefilled, new_turn in after_compaction), after_compaction
    assert len(removed) >= 4
    if policy_name == "sliding_window":
        assert shifted
    if policy_name == "summarize":
        assert session.messages[0].content.startswith(SUMMARY_PREFIX)
