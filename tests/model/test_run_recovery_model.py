"""On the real model: a tool call cut by a small token limit is retried with room and runs; its
markup never becomes the answer (issue: 7 of 8 runs answered with a raw ``<tool_call>`` before)."""

from __future__ import annotations

import pytest

from agentkv import Agent, GenerationConfig, Runtime, tool

pytestmark = pytest.mark.model

QUESTIONS = [
    "Please remember my sister's name: Marguerite.",
    "Store the fact that the meeting moved to Thursday afternoon.",
    "Note that the dentist appointment is on the twelfth.",
]
"""A sample that takes every path (measured on this machine, default engine): the call fits the
first 32 tokens (the sister), is cut and retried with room and the answer then stops (the
meeting, an 86-token call), is cut and retried and the answer is cut by length in turn (the
dentist). The two questions dropped took these paths too (the locker code: fits; teal: cut and a
335-token retry holding two calls) for ~25 CPU-s more; the retry's room, not the call count, is
what the point rests on (the bounded grammar always fits it)."""


@tool
def remember(key: str, value: str) -> str:
    """Store a value under a key.

    Args:
        key: A short name for the fact.
        value: The fact to remember.
    """
    return f"stored {key}"


async def test_a_cut_tool_call_is_retried_with_room_and_never_becomes_the_answer(engine):
    agent = Agent(name="memo", instructions="You remember facts for the user with the remember tool.",
                  tools=[remember], tool_choice="required", generation=GenerationConfig(max_new_tokens=32),
                  max_model_calls=3)
    runtime = Runtime(engine)
    ran, reasons = 0, []
    try:
        for question in QUESTIONS:
            session = await runtime.open_conversation(agent)
            try:
                result = await runtime.run(session, question)
            except Exception as error:  # noqa: BLE001 - MaxModelCallsExceeded carries the run so far
                result = getattr(error, "result", None)
                assert result is not None, error
            reasons.append(result.finish_reason)
            assert "<tool_call>" not in result.final_text and "</tool_call>" not in result.final_text
            ran += any(m.role == "tool" and m.content.startswith("stored") for m in result.new_messages)
            await runtime.close_conversation(session)
    finally:
        await runtime.aclose()
    assert ran == len(QUESTIONS), reasons  # the bounded grammar always fits the retry's room


async def test_a_resume_after_an_answer_cut_by_max_new_tokens_reuses_all_held_kv_without_a_break(engine, tmp_path):
    from agentkv.memory import Store

    agent = Agent(name="cut", instructions="You are a helpful assistant.",
                  generation=GenerationConfig(max_new_tokens=8))
    url = f"sqlite:///{tmp_path / 'a.db'}"
    first = Runtime(engine, Store(url))
    session = await first.open_conversation(agent)
    assert (await first.run(session, "Tell me a long story about a lighthouse.")).finish_reason == "length"
    await first.aclose()
    later = Runtime(engine, Store(url), agents=[agent])
    resumed = await later.resume(session.id)
    held = resumed.resume_report.restored_tokens
    assert held > 0
    result = await later.run(resumed, "Go on.")
    assert result.call_metrics[0].reused_tokens >= held  # all the KV the snapshot held was used
    assert result.cache_breaks[0] is None
    await later.aclose()
