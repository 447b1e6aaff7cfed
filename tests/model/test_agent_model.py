"""The agent loop on the real model: grammar-forced tool calls and KV reuse across loop steps."""

from __future__ import annotations

import pytest

from agentkv import Agent, GenerationConfig, Runtime, calculator, clock

pytestmark = pytest.mark.model


async def test_two_step_tool_loop_prefills_only_the_tool_result_delta(engine):
    agent = Agent(
        name="calc-agent",
        instructions="You are a calculator assistant. Use the calculator tool for arithmetic.",
        tools=[calculator, clock],
        tool_choice="required",
        max_model_calls=2,
        generation=GenerationConfig(max_new_tokens=48),
    )
    runtime = Runtime(engine)
    session = await runtime.open_conversation(agent)
    result = await runtime.run(session, "What is 12 * 7?")
    # the model call that produced the call and the one after its result (on some CPUs the first
    # call is cut at 48 tokens and generated once more with room: that retry is the one that counts)
    first, second = result.call_metrics[-2:]
    assert len(result.tool_calls) == 1
    assert result.tool_calls[0].name in {"calculator", "clock"}
    tool_message = session.messages[2]
    assert tool_message.role == "tool"
    # Step 2 reuses everything step 1 read and generated; it prefills the tool result turn only.
    assert second.reused_tokens == first.prompt_tokens + first.generated_tokens - 1
    delta = runtime.renderer.message_tokens(tool_message, position=3)
    assert second.prefilled_tokens <= delta + 8
    await runtime.aclose()
