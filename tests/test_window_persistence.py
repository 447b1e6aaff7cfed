"""Compaction with a store: nothing is lost, and a resume rebuilds exactly the window it left."""

from __future__ import annotations

import pytest

from agentkv import Agent, Runtime
from agentkv.memory import Store
from agentkv.policies import SUMMARY_PREFIX, SummarizeAndReprefill, Truncation
from agentkv.testing import ScriptedEngine


def engine_with_replies(n: int) -> ScriptedEngine:
    # Replies of the conversation, and summaries for the summariser's temporary sessions.
    return ScriptedEngine([lambda call: "Summary: earlier talk." if "ummar" in call.prompt_text[:400]
                           else "answer " * 30] * n)


@pytest.mark.parametrize("policy", [Truncation(), SummarizeAndReprefill(max_summary_tokens=32)])
async def test_resume_after_compaction_rebuilds_the_same_window(tmp_path, policy):
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    agent = Agent(name="w", instructions="Be brief.", policy=policy, max_prompt_len=700, min_response_len=100)
    async with Store(url) as store:
        runtime = Runtime(engine_with_replies(200), store, agents=[agent])
        session = await runtime.open_conversation(agent, conversation_id="w")
        for turn in range(12):
            await runtime.run(session, f"turn {turn}: " + "tell me more " * 20)
        window = [(e.message.role, e.message.content) for e in session.window]
        stored = await store.messages("w")
        assert any(not m.in_window for m in stored), "the conversation should have been compacted"
        if isinstance(policy, SummarizeAndReprefill):
            summaries = [m for m in stored if m.message.content.startswith(SUMMARY_PREFIX)]
            assert summaries and all(m.in_window or m.replaced_by_seq for m in summaries)
            assert any(m.replaced_by_seq == summaries[0].seq for m in stored)
        # Every message ever recorded is still in the store.
        user_turns = [m.message.content for m in stored if m.message.role == "user"]
        assert sum(c.startswith("turn ") for c in user_turns) == 12
        await runtime.aclose()

        again = Runtime(engine_with_replies(10), store, agents=[agent])
        resumed = await again.resume("w")
        assert [(e.message.role, e.message.content) for e in resumed.window] == window
        await again.aclose()
