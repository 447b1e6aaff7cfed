"""The ``@tool`` decorator and the ``Tool`` it makes: a function the model can call by name.

::

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        '''
        return a + b

    add(2, 3)                              # 5: still the function
    await add.invoke({"a": 2, "b": 3})     # "5": validated, run, serialised
    add.schema_for_prompt()                # {"type": "function", "function": {...}}

    @tool(name="slow_search", timeout_s=5.0, max_result_chars=4000)
    async def search(query: str) -> list[str]: ...
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, overload

from pydantic import BaseModel

from agentkv.errors import UserError
from agentkv.tools.external import external_schema
from agentkv.tools.results import serialize_result, truncate_text
from agentkv.tools.schema import FunctionSchema, function_schema
from agentkv.tools.threads import run_on_daemon_thread

DEFAULT_MAX_RESULT_CHARS = 8_000
"""Results longer than this many characters are cut (with a marker) unless a tool says otherwise."""


@dataclass(frozen=True, eq=False)
class Tool:
    """A function with the schema, limits and runner the agent loop needs. Make one with ``@tool``."""

    function: Callable[..., Any] | None
    """The decorated function (sync or async); None for a tool the caller executes (made from a
    raw OpenAI schema: ``tool({"type": "function", "function": {...}})``)."""
    spec: FunctionSchema = field(repr=False)
    """Name, description, JSON schema and arguments model derived from the function."""
    timeout_s: float | None = None
    """Seconds a call may take; ``None`` leaves it to ``run_tool_calls(default_timeout_s=...)``."""
    max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS
    """Results are cut to this many characters (plus a marker); ``None`` keeps them whole."""
    requires_approval: bool = False
    """A call waits for a person's approval before it runs (``agentkv.run.approvals``): the run stops
    with ``finish_reason="approval_required"``."""

    def __post_init__(self) -> None:
        timeout = self.timeout_s
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise UserError(f"tool {self.name!r}: timeout_s must be > 0 (a number of seconds) or None, got {timeout!r}")
        cap = self.max_result_chars
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
            raise UserError(
                f"tool {self.name!r}: max_result_chars must be >= 1 or None, got {self.max_result_chars!r}"
            )

    @property
    def name(self) -> str:
        """The name the model calls the tool by."""
        return self.spec.name

    @property
    def description(self) -> str:
        """What the tool does (the docstring's first paragraph unless given)."""
        return self.spec.description

    @property
    def parameters(self) -> dict[str, Any]:
        """JSON schema of the arguments."""
        return self.spec.parameters

    @property
    def args_model(self) -> type[BaseModel]:
        """Pydantic model that validates the arguments."""
        return self.spec.args_model

    @property
    def is_external(self) -> bool:
        """True when the caller executes the tool: a run stops at its calls (``finish_reason
        "tool_calls"``) and continues with the results the caller sends."""
        return self.function is None

    @property
    def is_async(self) -> bool:
        """True for ``async def`` tools; sync tools run on a daemon thread."""
        return self.function is not None and _is_async_callable(self.function)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the original function directly (no validation, no limits)."""
        return self._function()(*args, **kwargs)

    def _function(self) -> Callable[..., Any]:
        if self.function is None:
            raise UserError(f"tool {self.name!r} has no function: the caller executes it and answers its calls "
                            "with tool messages ({'role': 'tool', 'tool_call_id': ..., 'content': ...})")
        return self.function

    def schema_for_prompt(self) -> dict[str, Any]:
        """The OpenAI tool format: ``{"type": "function", "function": {name, description, parameters}}``."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": copy.deepcopy(self.parameters),
            },
        }

    def validate_arguments(self, arguments: Mapping[str, Any]) -> BaseModel:
        """Validate the model's arguments; raises ``pydantic.ValidationError``."""
        return self.args_model.model_validate(dict(arguments))

    async def call_validated(self, validated: BaseModel) -> str:
        """Run the function on validated arguments and return its result as capped text.

        Sync functions run on a daemon thread (one that hangs past its timeout never delays the
        process's exit). No timeout here: ``run_tool_calls`` applies it. Whatever the function
        raises propagates; a result that cannot become text raises ``ToolResultNotText``.
        """
        function = self._function()
        args, kwargs = self.spec.call_arguments(validated)
        if self.is_async:
            result = await function(*args, **kwargs)
        else:
            call = functools.partial(function, *args, **kwargs)
            result = await run_on_daemon_thread(call, name=f"agentkv-tool-{self.name}")
            if inspect.isawaitable(result):
                result = await result
        return truncate_text(serialize_result(result), self.max_result_chars)

    async def invoke(self, arguments: Mapping[str, Any]) -> str:
        """Validate ``arguments``, run the tool, return the result as text.

        ``await add.invoke({"a": 2, "b": 3})`` → ``"5"``. Raises ``pydantic.ValidationError`` on bad
        arguments and whatever the tool raises; ``run_tool_calls`` turns both into error results.
        """
        return await self.call_validated(self.validate_arguments(arguments))


@overload
def tool(
    function: Callable[..., Any],
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    requires_approval: bool = False,
) -> Tool: ...


@overload
def tool(
    function: Mapping[str, Any],
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    requires_approval: bool = False,
) -> Tool: ...


@overload
def tool(
    function: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    requires_approval: bool = False,
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    function: Callable[..., Any] | Mapping[str, Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = None,
    max_result_chars: int | None = DEFAULT_MAX_RESULT_CHARS,
    requires_approval: bool = False,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make a :class:`Tool` of a function: ``@tool`` or ``@tool(name=..., timeout_s=...)``;
    ``@tool(requires_approval=True)``: each call waits for a person's approval (``agentkv.run.approvals``).

    Raises ``UserError`` at once when the function cannot be a tool (a parameter without a type
    annotation, ``*args``/``**kwargs``, a name the tool format refuses, a non-callable).

    A dict in OpenAI function format makes a tool the caller executes (``tools/external.py``)::

        lookup = tool({"type": "function", "function": {"name": "lookup", "parameters": {...}}})
    """
    if isinstance(function, Mapping):
        if name is not None or description is not None or timeout_s is not None or requires_approval:
            raise UserError("a tool made from a schema takes its name and description from the schema; "
                            "drop name=/description=/timeout_s=/requires_approval= (the caller runs it, so "
                            "no timeout applies and the caller approves it)")
        return Tool(None, external_schema(function), max_result_chars=max_result_chars)

    def decorate(target: Callable[..., Any]) -> Tool:
        if isinstance(target, Tool):
            raise UserError(
                f"{target.name!r} is already a Tool; to change its options wrap the function: "
                f"tool({target.name}.function, ...)"
            )
        spec = function_schema(target, name=name, description=description)
        return Tool(target, spec, timeout_s=timeout_s, max_result_chars=max_result_chars,
                    requires_approval=requires_approval)

    if function is None:
        return decorate
    return decorate(function)


def _is_async_callable(function: Callable[..., Any]) -> bool:
    """True for coroutine functions, partials of them and objects with an ``async def __call__``."""
    if inspect.iscoroutinefunction(function):
        return True
    call = getattr(type(function), "__call__", None)
    return not inspect.isroutine(function) and inspect.iscoroutinefunction(call)
