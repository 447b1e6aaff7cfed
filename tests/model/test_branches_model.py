"""On the real model: a fork continues on its parent's KV — its first turn reuses the shared
messages' KV — and, greedy, answers exactly what the parent answered from the same point."""

from __future__ import annotations

import pytest

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.memory import Store

pytestmark = pytest.mark.model


async def test_a_forks_answers_are_the_parents_would_have_been_answers(engine, tmp_path):
    agent = Agent(name="greedy", instructions="Answer in one short sentence.",
                  generation=GenerationConfig(max_new_tokens=16, temperature=0))
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    runtime = Runtime(engine, store)
    session = await runtime.open_conversation(agent)
    await runtime.run(session, "Name a fruit.")
    at = await store.last_seq(session.id)
    shared = len(session.kv.tokens)
    parent_next = await runtime.run(session, "Name a colour.")
    branch = await runtime.fork(session, at=at)
    assert branch.resume_report.restored_tokens >= shared - 1
    fork_next = await runtime.run(branch, "Name a colour.")
    assert fork_next.final_text == parent_next.final_text
    first = fork_next.call_metrics[0]
    assert first.reused_tokens >= shared - 1 and first.prefilled_tokens == first.prompt_tokens - first.reused_tokens
    diverged = await runtime.run(branch, "Name an animal.")
    assert "animal" not in " ".join(m.content for m in session.messages)
    assert diverged.new_messages[0].content == "Name an animal."
    await runtime.aclose()
