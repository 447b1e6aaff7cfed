"""Structured final output (``Agent(output_type=...)``): the answer is decoded under the schema's
grammar (with or without tools) and parsed into the model; what cannot be parsed says so.

The tests here run the real model; the scripted ones are in ``tests/test_structured_output.py``."""

from __future__ import annotations

import pytest
from test_structured_output import City

from agentkv import Agent, Runtime

pytestmark = pytest.mark.model


async def test_on_the_model_the_answer_is_always_a_valid_instance_of_the_output_type(engine):
    agent = Agent(name="geo-model", output_type=City, generation={"max_new_tokens": 64})
    runtime = Runtime(engine)
    try:
        for question in ("The largest city in France?", "Name a city in Japan."):
            session = await runtime.open_conversation(agent)
            result = await runtime.run(session, question)
            assert result.finish_reason == "stop", result.final_text
            assert isinstance(result.output, City)
            assert City.model_validate_json(result.final_text) == result.output
    finally:
        await runtime.aclose()
