"""Tools the caller executes (raw OpenAI schemas) and runs that start from OpenAI messages, on
the scripted engine: the run stops at such calls, the caller's results continue it on the same
KV, and input that cannot follow the history is refused before anything is recorded.

The tests here run the real model; the scripted ones are in ``tests/test_external_tools.py``."""

from __future__ import annotations

import json

import pytest
from test_external_tools import WEATHER

from agentkv import Agent, Message, Runtime

pytestmark = pytest.mark.model


async def test_on_the_model_a_caller_executed_call_follows_its_schema_and_the_result_prefills_alone(engine):
    agent = Agent(name="weather-model", tools=[WEATHER], tool_choice="required",
                  generation={"max_new_tokens": 48})
    runtime = Runtime(engine)
    session = await runtime.open_conversation(agent)
    try:
        first = await runtime.run(session, "What is the weather in Paris?")
        assert first.finish_reason == "tool_calls"
        [pending] = first.pending_tool_calls
        assert pending.name == "get_weather" and isinstance(pending.arguments.get("city"), str)
        result = json.dumps({"city": pending.arguments["city"], "temperature_c": 18})
        second = await runtime.run(session, [{"role": "tool", "tool_call_id": pending.id, "content": result}])
        assert second.finish_reason in ("stop", "length", "tool_calls")
        step, before = second.call_metrics[0], first.call_metrics[-1]
        # everything the first run read and wrote is reused: only the tool turn is prefilled
        assert step.reused_tokens >= before.prompt_tokens + before.generated_tokens - 1
        # + the turn's markup: the template wraps a tool result in 24 tokens here (measured)
        assert step.prefilled_tokens <= len(engine.tokenizer.encode(result)) + 32
    finally:
        await runtime.aclose()


async def test_on_the_model_no_instructions_means_the_templates_default_system_prompt_shared_as_a_prefix(engine):
    runtime = Runtime(engine)
    session = await runtime.open_conversation(Agent(name="template-default", instructions=None))
    prompt = session.render_with(session.agent, [Message.user("hi")])
    assert "You are a helpful AI assistant named SmolLM" in engine.tokenizer.decode(list(prompt.token_ids[:40]))
    assert engine.boundaries.prefixes_of(prompt.token_ids)  # the default system turn is a shared prefix
    await runtime.aclose()
