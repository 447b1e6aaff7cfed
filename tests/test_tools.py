"""Tests of agentkv.tools: schemas from signatures, execution (errors, timeouts, concurrency), built-ins."""

import contextvars
import enum
import json
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from typing import Annotated, Literal, Optional

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field, ValidationError

from agentkv.chat.messages import ToolCall
from agentkv.errors import ToolResultNotText, UserError
from agentkv.tools import Tool, ToolOutcome, clock, run_tool_calls, tool
from agentkv.tools.docstrings import parse_docstring
from agentkv.tools.results import serialize_result, truncate_text


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Point(BaseModel):
    x: int
    y: int = 0


@tool
def add(a: int, b: int = 1) -> int:
    """Add two integers.

    The second is optional.

    Args:
        a: The first integer.
        b (int): The second integer,
            which may be negative.

    Returns:
        The sum.
    """
    return a + b


@tool
async def async_add(a: int, b: int) -> int:
    """Add two integers, asynchronously."""
    return a + b


def sleeper(name: str, seconds: float, **options) -> Tool:
    """An async tool that sleeps ``seconds`` then returns ``name``."""

    async def sleep_then_answer() -> str:
        await anyio.sleep(seconds)
        return name

    return tool(sleep_then_answer, name=name, **options)


def call(name: str, **arguments) -> ToolCall:
    return ToolCall(name=name, arguments=arguments)


# --- schema from signature and docstring -------------------------------------------------------


def test_schema_has_types_defaults_required_and_docstring_descriptions():
    assert add.name == "add"
    assert add.description == "Add two integers."
    assert add.parameters == {
        "type": "object",
        "additionalProperties": False,
        "properties": {
            "a": {"type": "integer", "description": "The first integer."},
            "b": {
                "type": "integer",
                "default": 1,
                "description": "The second integer, which may be negative.",
            },
        },
        "required": ["a"],
    }


def test_schema_for_prompt_is_the_openai_tool_format():
    prompt = add.schema_for_prompt()
    assert prompt == {
        "type": "function",
        "function": {"name": "add", "description": "Add two integers.", "parameters": add.parameters},
    }
    prompt["function"]["parameters"]["properties"].clear()
    assert add.parameters["properties"], "schema_for_prompt must hand out a copy"


def test_literal_enum_optional_and_model_arguments_have_their_schemas():
    @tool
    def paint(mode: Literal["fast", "slow"], color: Color, where: Point, note: Optional[str] = None) -> str:
        """Paint."""
        return f"{mode} {color.value} {where.x},{where.y} {note}"

    properties = paint.parameters["properties"]
    assert properties["mode"] == {"type": "string", "enum": ["fast", "slow"]}
    assert properties["color"] == {"$ref": "#/$defs/Color"}
    assert paint.parameters["$defs"]["Color"]["enum"] == ["red", "green"]
    assert properties["where"] == {"$ref": "#/$defs/Point"}
    assert properties["note"] == {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None}
    assert paint.parameters["required"] == ["mode", "color", "where"]


async def test_model_and_enum_arguments_reach_the_function_as_instances():
    @tool
    def describe(where: Point, color: Color, note: Optional[str] = None) -> str:
        """Describe."""
        assert isinstance(where, Point) and isinstance(color, Color)
        return f"{where.x},{where.y} {color.name} {note}"

    assert await describe.invoke({"where": {"x": 2}, "color": "green"}) == "2,0 GREEN None"
    assert await describe.invoke({"where": {"x": 2}, "color": "red", "note": None}) == "2,0 RED None"


def test_explicit_field_description_wins_over_the_docstring():
    @tool
    def search(query: Annotated[str, Field(description="explicit")], limit: int = Field(5, ge=1)) -> str:
        """Search.

        Args:
            query: from the docstring.
            limit: how many results.
        """
        return query

    properties = search.parameters["properties"]
    assert properties["query"]["description"] == "explicit"
    assert properties["limit"] == {
        "type": "integer",
        "default": 5,
        "minimum": 1,
        "description": "how many results.",
    }


def test_parameter_names_pydantic_reserves_still_work():
    @tool
    def parse(json: str, _hidden: int = 0, model_config: str = "c") -> str:
        """Parse."""
        return f"{json}|{_hidden}|{model_config}"

    assert set(parse.parameters["properties"]) == {"json", "_hidden", "model_config"}
    assert anyio.run(parse.invoke, {"json": "j", "_hidden": 3}) == "j|3|c"


async def test_positional_only_and_keyword_only_parameters_are_called_correctly():
    @tool
    def combine(a: str, /, b: str, *, c: str) -> str:
        """Combine."""
        return a + b + c

    assert await combine.invoke({"a": "x", "b": "y", "c": "z"}) == "xyz"


def test_docstring_parser_handles_missing_docstring_and_leading_section():
    assert parse_docstring(None).summary == ""
    parsed = parse_docstring("Args:\n    x: the x.\n")
    assert parsed.summary == ""
    assert parsed.arguments == {"x": "the x."}


def test_docstring_parser_reads_numpy_and_sphinx_styles():
    numpy_style = parse_docstring(
        """Add.

        Parameters
        ----------
        a : int
            The first.
        b
            The second,
            which may be negative.
        """
    )
    assert numpy_style.summary == "Add."
    assert numpy_style.arguments == {"a": "The first.", "b": "The second, which may be negative."}
    sphinx_style = parse_docstring("Add.\n\n:param a: The first.\n:param int b: The second.\n:type a: int\n")
    assert sphinx_style.summary == "Add."
    assert sphinx_style.arguments == {"a": "The first.", "b": "The second."}


def test_docstring_parser_keeps_arguments_with_nested_types_and_keyword_sections():
    parsed = parse_docstring(
        """Store.

        Args:
            x (dict[str, (int)]): A mapping.
            y (int): Plain.

        Keyword Args:
            z: Keyword only.
        """
    )
    assert parsed.arguments == {"x": "A mapping.", "y": "Plain.", "z": "Keyword only."}


def test_docstring_parser_accepts_sections_without_a_blank_line_and_logs_nothing(caplog):
    with caplog.at_level("DEBUG"):
        parsed = parse_docstring("Add.\nArgs:\n    x: the x.\nReturns:\n    the sum.\n")
        parse_docstring(":param a: no matching parameter, no type.\n")
    assert (parsed.summary, parsed.arguments) == ("Add.", {"x": "the x."})
    assert caplog.records == []


def test_numpy_docstring_describes_the_tool_schema():
    @tool
    def scale(value: float, factor: float = 2.0) -> float:
        """Scale a value.

        Parameters
        ----------
        value
            What to scale.
        factor
            By how much.
        """
        return value * factor

    properties = scale.parameters["properties"]
    assert properties["value"]["description"] == "What to scale."
    assert properties["factor"]["description"] == "By how much."


def test_description_option_overrides_the_docstring():
    @tool(description="Custom text.")
    def f(x: int) -> int:
        """Docstring text."""
        return x

    assert f.description == "Custom text."


# --- the decorator: options, callability, misuse ----------------------------------------------------


async def test_tool_stays_callable_like_the_original_function():
    assert add(2, 3) == 5
    assert await async_add(2, 3) == 5
    assert async_add.is_async and not add.is_async


def test_decorator_options_set_name_timeout_and_result_cap():
    @tool(name="calc", timeout_s=5.0, max_result_chars=4000)
    def compute(x: int) -> int:
        """Compute."""
        return x

    assert (compute.name, compute.timeout_s, compute.max_result_chars) == ("calc", 5.0, 4000)


async def test_a_bound_method_can_be_a_tool():
    class Counter:
        def __init__(self) -> None:
            self.total = 0

        def bump(self, by: int) -> int:
            """Bump the counter."""
            self.total += by
            return self.total

    counter = Counter()
    bump = tool(counter.bump)
    assert list(bump.parameters["properties"]) == ["by"]
    assert await bump.invoke({"by": 4}) == "4"


def _no_annotation(x):  # pragma: no cover - only decorated
    return x


def _var_args(*values: int) -> int:  # pragma: no cover - only decorated
    return sum(values)


def _var_kwargs(**options: int) -> int:  # pragma: no cover - only decorated
    return len(options)


@pytest.mark.parametrize(
    ("target", "options", "message"),
    [
        (_no_annotation, {}, "parameter 'x' of tool '_no_annotation' has no type annotation"),
        (_var_args, {}, "takes *values"),
        (_var_kwargs, {}, "takes **options"),
        (42, {}, "@tool needs a function"),
        ("calc", {}, "pass name= as a keyword"),
        (lambda x: x, {}, "tool name '<lambda>' is not allowed"),
        (add.function, {"name": "has space"}, "tool name 'has space' is not allowed"),
        (add.function, {"timeout_s": 0}, "timeout_s must be > 0"),
        (add.function, {"max_result_chars": 0}, "max_result_chars must be >= 1"),
        (add.function, {"timeout_s": "5"}, "timeout_s must be > 0"),
        (add.function, {"timeout_s": float("nan")}, "timeout_s must be > 0"),
        (add.function, {"max_result_chars": 1.5}, "max_result_chars must be >= 1"),
        (add, {}, "is already a Tool"),
    ],
)
def test_misuse_raises_user_error_at_decoration_time(target, options, message):
    with pytest.raises(UserError, match=message.replace("*", r"\*").replace("(", r"\(")):
        tool(target, **options)


def test_invoke_refuses_extra_and_invalid_arguments_with_pydantic_errors():
    with pytest.raises(ValidationError):
        anyio.run(add.invoke, {"a": 1, "c": 2})
    with pytest.raises(ValidationError):
        anyio.run(add.invoke, {"a": "x"})


# --- execution ----------------------------------------------------------------------------------------


async def test_sync_and_async_tools_run_and_results_are_serialised():
    @tool
    def as_dict(key: str) -> dict:
        """Dict."""
        return {"key": key, "when": datetime(2026, 1, 2, tzinfo=timezone.utc)}

    @tool
    async def as_model(x: int) -> Point:
        """Model."""
        return Point(x=x, y=2)

    @tool
    def nothing() -> None:
        """Nothing."""

    outcomes = await run_tool_calls(
        [add, as_dict, as_model, nothing],
        [call("add", a=2, b=3), call("as_dict", key="é"), call("as_model", x=1), call("nothing")],
    )
    assert [o.content for o in outcomes] == [
        "5",
        '{"key": "é", "when": "2026-01-02T00:00:00Z"}',
        '{"x":1,"y":2}',
        "",
    ]
    assert not any(o.is_error for o in outcomes)
    assert all(isinstance(o, ToolOutcome) and o.duration_s >= 0 for o in outcomes)


async def test_invalid_arguments_become_an_error_text_for_the_model():
    [wrong_type, missing, extra] = await run_tool_calls(
        [add], [call("add", a=1, b="x"), call("add", b=2), call("add", a=1, c=3)]
    )
    assert wrong_type.is_error
    assert wrong_type.content == (
        "error: invalid arguments for 'add': b: Input should be a valid integer, "
        "unable to parse string as an integer (got 'x')"
    )
    assert missing.content == "error: invalid arguments for 'add': a: Field required"
    assert extra.content == "error: invalid arguments for 'add': c: Extra inputs are not permitted"


async def test_an_exception_in_a_tool_becomes_an_error_outcome():
    @tool
    def divide(a: float, b: float) -> float:
        """Divide."""
        return a / b

    @tool
    async def fail_quietly() -> str:
        """Fail without a message."""
        raise RuntimeError

    calls = [call("divide", a=1, b=0), call("fail_quietly")]
    [zero, quiet] = await run_tool_calls([divide, fail_quietly], calls)
    assert zero.is_error
    assert zero.content == "error: tool 'divide' raised ZeroDivisionError: float division by zero"
    assert quiet.is_error and quiet.content == "error: tool 'fail_quietly' raised RuntimeError"


async def test_unknown_tool_lists_the_available_ones():
    [outcome] = await run_tool_calls([clock, add], [call("foo")])
    assert outcome.is_error
    assert outcome.content == "error: unknown tool 'foo'; available tools: add, clock"


async def test_a_slow_async_tool_times_out_with_its_own_timeout():
    slow = sleeper("slow", 5.0, timeout_s=0.1)
    started = time.perf_counter()
    [outcome] = await run_tool_calls([slow], [call("slow")], default_timeout_s=30)
    assert time.perf_counter() - started < 1.0
    assert outcome.is_error and outcome.content == "error: tool 'slow' timed out after 0.1 s"


async def test_a_blocked_sync_tool_times_out_without_waiting_for_its_thread():
    release = threading.Event()

    @tool
    def blocked() -> str:
        """Block until released."""
        release.wait(5.0)
        return "done"

    started = time.perf_counter()
    try:
        [outcome] = await run_tool_calls([blocked], [call("blocked")], default_timeout_s=0.2)
    finally:
        release.set()
    assert time.perf_counter() - started < 1.0
    assert outcome.content == "error: tool 'blocked' timed out after 0.2 s"


def test_a_sync_tool_hung_past_its_timeout_does_not_keep_the_process_alive():
    code = (
        "import threading, anyio\n"
        "from agentkv.chat.messages import ToolCall\n"
        "from agentkv.tools import run_tool_calls, tool\n"
        "@tool(timeout_s=0.2)\n"
        "def hung() -> str:\n"
        "    'Block forever.'\n"
        "    threading.Event().wait()\n"
        "[outcome] = anyio.run(run_tool_calls, [hung], [ToolCall(name='hung')])\n"
        "print(outcome.content)\n"
    )
    # NOTE: the tool never returns: before, the interpreter waited for its thread at exit forever
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "error: tool 'hung' timed out after 0.2 s"


async def test_sync_tools_run_on_daemon_threads_in_the_callers_context():
    tag = contextvars.ContextVar("tag", default="unset")
    tag.set("caller")

    @tool
    def where() -> dict:
        """Say which thread runs the tool."""
        return {"daemon": threading.current_thread().daemon, "tag": tag.get()}

    [outcome] = await run_tool_calls([where], [call("where")])
    assert json.loads(outcome.content) == {"daemon": True, "tag": "caller"}


async def test_a_tool_returning_utf8_bytes_gives_their_text():
    @tool
    def data() -> bytes:
        """Return bytes."""
        return "café".encode()

    [outcome] = await run_tool_calls([data], [call("data")])
    assert (outcome.is_error, outcome.content) == (False, "café")


async def test_a_result_with_no_text_form_is_reported_as_a_serialisation_failure_not_a_tool_error():
    @tool
    def blob() -> dict:
        """Return raw bytes inside a dict."""
        return {"png": b"\x89PNG\xff"}

    [outcome] = await run_tool_calls([blob], [call("blob")])
    assert outcome.is_error
    assert outcome.content.startswith("error: tool 'blob' ran, but its result could not be turned into text")
    assert "raised" not in outcome.content and "base64" in outcome.content
    with pytest.raises(ToolResultNotText) as caught:
        serialize_result(b"\xff")
    assert caught.value.type_name == "bytes"


async def test_a_timeout_error_raised_by_the_tool_is_not_reported_as_our_timeout():
    @tool
    async def flaky() -> str:
        """Raise TimeoutError itself."""
        raise TimeoutError("upstream did not answer")

    [outcome] = await run_tool_calls([flaky], [call("flaky")])
    assert outcome.content == "error: tool 'flaky' raised TimeoutError: upstream did not answer"


async def test_calls_run_concurrently_and_outcomes_keep_call_order():
    first, second = sleeper("first", 0.3), sleeper("second", 0.2)
    started = time.perf_counter()
    outcomes = await run_tool_calls([first, second], [call("first"), call("second"), call("first")])
    assert time.perf_counter() - started < 0.5
    assert [o.content for o in outcomes] == ["first", "second", "first"]


async def test_sync_tools_also_run_concurrently_in_threads():
    @tool
    def nap(tag: str) -> str:
        """Sleep in a thread."""
        time.sleep(0.3)
        return tag

    started = time.perf_counter()
    outcomes = await run_tool_calls([nap], [call("nap", tag="a"), call("nap", tag="b")])
    assert time.perf_counter() - started < 0.5
    assert [o.content for o in outcomes] == ["a", "b"]


async def test_long_results_are_cut_with_a_visible_marker():
    @tool(max_result_chars=10)
    def long_text() -> str:
        """Long."""
        return "x" * 1244

    [outcome] = await run_tool_calls([long_text], [call("long_text")])
    assert outcome.content == "x" * 10 + "…[truncated 1234 chars]"
    assert not outcome.is_error


async def test_cancelling_the_caller_propagates_and_cancels_the_tools():
    seen_cancellation = anyio.Event()

    @tool
    async def wait_forever() -> str:
        """Wait."""
        try:
            await anyio.sleep(10)
        except anyio.get_cancelled_exc_class():
            seen_cancellation.set()
            raise
        return "never"

    started = time.perf_counter()
    result = None
    with anyio.move_on_after(0.2) as scope:
        result = await run_tool_calls([wait_forever], [call("wait_forever")], default_timeout_s=30)
    assert scope.cancelled_caught and result is None
    assert seen_cancellation.is_set()
    assert time.perf_counter() - started < 1.0


async def test_outcome_becomes_a_tool_message_and_empty_calls_give_no_outcomes():
    the_call = call("add", a=1)
    [outcome] = await run_tool_calls([add], [the_call])
    message = outcome.to_message()
    assert (message.role, message.content) == ("tool", "2")
    assert (message.tool_call_id, message.name) == (the_call.id, "add")
    assert await run_tool_calls([add], []) == []


async def test_duplicate_tool_names_and_a_bad_default_timeout_are_user_errors():
    with pytest.raises(UserError, match="two tools are named 'add'"):
        await run_tool_calls([add, tool(add.function)], [call("add", a=1)])
    with pytest.raises(UserError, match="default_timeout_s must be > 0"):
        await run_tool_calls([add], [call("add", a=1)], default_timeout_s=0)


@settings(max_examples=100, deadline=None)
@given(text=st.text(max_size=200), cap=st.integers(min_value=1, max_value=100))
def test_truncation_keeps_a_prefix_and_counts_what_it_cut(text, cap):
    cut = truncate_text(text, cap)
    if len(text) <= cap:
        assert cut == text
    else:
        kept, marker = cut[:cap], cut[cap:]
        assert text.startswith(kept)
        assert marker == f"…[truncated {len(text) - cap} chars]"


# --- built-ins ----------------------------------------------------------------------------------------
