"""Invalid agent and engine settings fail at construction with a UserError that says the fix."""

from __future__ import annotations

import math

import pydantic
import pytest

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.errors import UserError
from agentkv.policies import SlidingWindow, SummarizeAndReprefill
from agentkv.testing import ScriptedEngine


def double(x: int) -> int:
    """Double a number."""
    return 2 * x


def test_a_dict_of_generation_settings_becomes_a_generation_config():
    agent = Agent(name="a", generation={"max_new_tokens": 5})
    assert agent.generation == GenerationConfig(max_new_tokens=5)


def test_a_plain_function_becomes_a_tool_with_a_schema_from_its_signature():
    agent = Agent(name="a", tools=[double])
    assert agent.tools[0].name == "double"
    assert agent.tool_schemas[0]["function"]["parameters"]["properties"]["x"]["type"] == "integer"


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"generation": {"max_new_tokens": -1}}, "invalid generation settings"),
        ({"generation": "fast"}, "GenerationConfig or a dict"),
        ({"tools": [3]}, "tools must be functions"),
        ({"max_prompt_len": 100}, "min_response_len"),
        ({"tool_timeout_s": -1}, "tool_timeout_s must be > 0"),
        ({"max_model_calls": 0}, "max_model_calls must be >= 1"),
        ({"name": " "}, "non-empty"),
        ({"needs_approval": 5}, "needs_approval must be a function"),
        ({"tool_timeout_s": math.nan}, "tool_timeout_s must be a finite number"),
        ({"tool_timeout_s": math.inf}, "tool_timeout_s must be a finite number"),
        ({"tool_timeout_s": "30"}, "tool_timeout_s must be a finite number"),
        ({"policy": "sliding"}, r"policy=SlidingWindow\(\)"),
        ({"policy": SlidingWindow}, r"policy=SlidingWindow\(\)"),  # the class, not an instance
        ({"max_model_calls": 2.5}, "max_model_calls must be a whole number"),
        ({"max_model_calls": "3"}, "max_model_calls must be a whole number"),
        ({"min_response_len": math.inf}, "min_response_len must be a whole number"),
        ({"max_prompt_len": 1024.0}, "max_prompt_len must be a whole number"),
        ({"constrain_tool_calls": "yes"}, "constrain_tool_calls must be True or False"),
        ({"parallel_tool_calls": None}, "parallel_tool_calls must be True or False"),
        ({"truncate_oversized_messages": 1}, "truncate_oversized_messages must be True or False"),
        ({"settings": 3}, "settings must be a dict"),
        ({"tool_choice": 3}, "tool_choice must be"),
        ({"tools": double}, r"tools must be a list, e.g. Agent\(..., tools=\[add\]\)"),
        ({"generation": {"temperature": math.inf}}, "finite number"),
    ],
)
def test_invalid_settings_are_refused_at_construction_with_the_fix(options, says):
    with pytest.raises(UserError, match=says):
        Agent(**{"name": "a", **options})


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"temperature": math.inf}, "finite number"),
        ({"top_p": math.nan}, "finite number"),
        ({"repetition_penalty": math.inf}, "finite number"),
        ({"length_penalty": math.nan}, "finite number"),
        ({"presence_penalty": math.nan}, "finite number"),
        ({"min_p": math.nan}, "finite number"),
        ({"seed": -1}, "greater than or equal to 0"),
        ({"stop_strings": ("",)}, "empty stop string"),
        ({"stop_token_ids": frozenset({-3})}, "token ids"),
    ],
)
def test_generation_settings_refuse_nan_infinities_and_values_that_would_fail_mid_run(options, says):
    with pytest.raises(pydantic.ValidationError, match=says):
        GenerationConfig(**options)


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda: SlidingWindow(low_water="0.5"), "low_water must be a fraction"),
        (lambda: SlidingWindow(low_water=math.nan), "low_water must be a fraction"),
        (lambda: SummarizeAndReprefill(max_attempts=1.5), "max_attempts must be a whole number"),
        (lambda: SummarizeAndReprefill(chunk_tokens=True), "chunk_tokens must be a whole number"),
    ],
)
def test_policy_settings_of_the_wrong_kind_are_refused_at_construction(make, says):
    with pytest.raises(UserError, match=says):
        make()


@pytest.mark.parametrize("bad_input", [None, 5, b"hi", {"role": "user", "content": "hi"}])
async def test_a_run_input_that_is_neither_text_nor_messages_is_a_user_error_saying_what_to_pass(bad_input):
    engine = ScriptedEngine([])
    runtime = Runtime(engine)
    session = await runtime.open_conversation(Agent(name="a"))
    with pytest.raises(UserError, match="a run takes a user message's text"):
        await runtime.run(session, bad_input)
    assert session.messages == [] and engine.calls == []


