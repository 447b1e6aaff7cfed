"""Invalid agent and engine settings fail at construction with a UserError that says the fix."""

from __future__ import annotations

import pytest

from agentkv import Agent, GenerationConfig
from agentkv.errors import UserError


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
        ({"max_turns": 0}, "max_turns must be >= 1"),
        ({"name": " "}, "non-empty"),
    ],
)
def test_invalid_settings_are_refused_at_construction_with_the_fix(options, says):
    with pytest.raises(UserError, match=says):
        Agent(**{"name": "a", **options})


@pytest.mark.model
def test_a_device_this_machine_lacks_is_a_user_error_naming_the_devices_it_has():
    import openvino as ov

    from agentkv.engine.stateful import StatefulEngine

    missing = next(d for d in ("GPU", "NPU", "FPGA") if d not in ov.Core().available_devices)
    with pytest.raises(UserError, match=r"this machine has \['CPU'"):
        StatefulEngine(device=missing, num_slots=1)
