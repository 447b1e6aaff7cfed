"""Tests of the built-in tools: the safe calculator and the clock."""

import json
import math
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import ToolCall
from agentkv.tools import calculator, clock, run_tool_calls
from agentkv.tools.arithmetic import MAX_EXPRESSION_CHARS, evaluate


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


@pytest.mark.parametrize(
    ("expression", "expected"),
    [
        ("1 + 2 * 3", 7),
        ("(1 + 2) * 3", 9),
        ("7 / 2", 3.5),
        ("7 // 2", 3),
        ("-7 % 3", 2),
        ("2 ** 10", 1024),
        ("-(3 - 5)", 2),
        ("2 ** -1", 0.5),
        ("sqrt(16) + abs(-2)", 6.0),
        ("sin(pi / 2) + cos(0)", 2.0),
        ("log(e) + log(8, 2)", 4.0),
        ("round(2.567, 2)", 2.57),
        ("min(3, 1, 2) + max(4, 5)", 6),
        ("1_000 * 1e-3", 1.0),
    ],
)
def test_calculator_computes_arithmetic(expression, expected):
    assert calculator(expression) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("x + 1", "unknown name 'x'"),
        ("__import__('os')", "function '__import__' is not allowed"),
        ("(1).__class__", "attribute access"),
        ("math.pi", "attribute access"),
        ("open('f')", "function 'open' is not allowed"),
        ("(lambda: 1)()", "cannot be called"),
        ("'a' * 3", "only numbers are allowed"),
        ("True + 1", "only numbers are allowed"),
        ("[1, 2]", "is not allowed in a calculation"),
        ("2 ^ 3", "write powers with \\*\\*"),
        ("9 ** 9 ** 9", "too large"),
        ("10 ** 5000", "too large"),
        ("2.0 ** 5000", "too large"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 / 0", "division by zero"),
        ("sqrt(-1)", "math domain error"),
        ("sqrt(x=4)", "positional arguments only"),
        ("round(1, 2, 3)", "takes 1 to 2 arguments"),
        ("1 +", "cannot parse"),
        ("", "empty"),
        ("1+" * MAX_EXPRESSION_CHARS + "1", "the limit is"),
    ],
)
def test_calculator_refuses_everything_but_arithmetic(expression, message):
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("(1).real", "attribute access"),
        ("1j", "only numbers are allowed"),
        ("1 < 2", "is not allowed in a calculation"),
        ("1 if 1 else 2", "is not allowed in a calculation"),
        ("1 and 2", "is not allowed in a calculation"),
        ("f'{1}'", "is not allowed in a calculation"),
        ("(1, 2)[0]", "is not allowed in a calculation"),
        ("sqrt", "unknown name 'sqrt'"),
        ("x = 5", "cannot parse"),
        ("1; 2", "cannot parse"),
        ("1e308 * 10", "not a finite number"),
        ("2 ** 4000000", "too large"),
        ("min(*[1, 2])", "positional arguments only"),
    ],
)
def test_calculator_refuses_what_a_general_expression_evaluator_allows(expression, message):
    # NOTE: simpleeval 1.0, given only our names, functions and operators, returns a value for
    # these, computes 2 ** 4000000, or raises an error that is not a ValueError: keep them refused.
    with pytest.raises(ValueError, match=message):
        evaluate(expression)


_leaf = st.integers(min_value=-50, max_value=50).map(lambda n: (f"({n})", n))


def _combine(children):
    def join(pair):
        (left_text, left), operation, (right_text, right) = pair
        value = {"+": left + right, "-": left - right, "*": left * right}[operation]
        return f"({left_text} {operation} {right_text})", value

    return st.tuples(children, st.sampled_from("+-*"), children).map(join)


@settings(max_examples=100, deadline=None)
@given(st.recursive(_leaf, _combine, max_leaves=12))
def test_calculator_agrees_with_integer_arithmetic(expression_and_value):
    expression, value = expression_and_value
    assert evaluate(expression) == value


async def test_calculator_refusal_reaches_the_model_as_an_error():
    [outcome] = await run_tool_calls([calculator], [call("calculator", expression="os.system('ls')")])
    assert outcome.is_error
    assert outcome.content.startswith("error: tool 'calculator' raised ValueError: attribute access")


async def test_clock_gives_iso_time_in_the_requested_timezone():
    text = await clock.invoke({"timezone": "Asia/Kolkata"})
    moment = datetime.fromisoformat(text)
    assert moment.utcoffset() == timedelta(hours=5, minutes=30)
    assert moment.utcoffset() == datetime.now(ZoneInfo("Asia/Kolkata")).utcoffset()
    assert abs(moment - datetime.now(timezone.utc)) < timedelta(seconds=5)


async def test_clock_defaults_to_utc_and_refuses_unknown_zones():
    assert datetime.fromisoformat(await clock.invoke({})).utcoffset() == timedelta(0)
    [outcome] = await run_tool_calls([clock], [call("clock", timezone="Mars/Olympus")])
    assert outcome.is_error and "unknown time zone 'Mars/Olympus'" in outcome.content


def test_builtin_tools_have_prompt_schemas():
    assert calculator.parameters["required"] == ["expression"]
    assert "pi" in calculator.parameters["properties"]["expression"]["description"]
    assert clock.parameters["properties"]["timezone"]["default"] is None
    json.dumps([calculator.schema_for_prompt(), clock.schema_for_prompt()])
    assert math.isclose(calculator("sqrt(2) ** 2"), 2.0)
