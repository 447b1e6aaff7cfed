"""Run the tool calls of one model call: concurrently, each under a timeout, failures as results.

::

    outcomes = await run_tool_calls([add, clock], message.tool_calls, default_timeout_s=10)
    history += [outcome.to_message() for outcome in outcomes]

A failure the model can act on (unknown tool, invalid arguments, the tool raised, the tool timed
out, its result has no text form) is an outcome with ``is_error=True`` whose text says what went
wrong; nothing is raised. The caller's cancellation is not a failure: it propagates. A sync tool
that times out is abandoned on its daemon thread (``tools/threads.py``): it never delays exit.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import anyio
from pydantic import ValidationError

from agentkv.chat.messages import Message, ToolCall
from agentkv.errors import ToolResultNotText, UserError
from agentkv.tools.decorator import DEFAULT_MAX_RESULT_CHARS, Tool
from agentkv.tools.results import truncate_text
from agentkv.validation_text import describe_problems

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolOutcome:
    """The result of one tool call, as the model will read it."""

    call: ToolCall
    """The call this answers."""
    content: str
    """The tool's result as text, or an error text starting with ``"error: "``."""
    is_error: bool
    """True when the call failed (unknown tool, invalid arguments, exception, timeout)."""
    duration_s: float
    """Wall-clock seconds from the start of validation to the result."""

    def to_message(self) -> Message:
        """The ``tool`` message that carries this result back to the model."""
        return Message.tool(self.content, tool_call_id=self.call.id, name=self.call.name)


async def run_tool_calls(
    tools: Sequence[Tool], calls: Sequence[ToolCall], *, default_timeout_s: float = 30.0
) -> list[ToolOutcome]:
    """Run ``calls`` concurrently against ``tools``; outcomes come back in call order.

    Each call gets its tool's ``timeout_s``, or ``default_timeout_s`` when the tool sets none.
    Raises ``UserError`` if two tools share a name or the default timeout is not positive.
    """
    if not default_timeout_s > 0:
        raise UserError(f"default_timeout_s must be > 0, got {default_timeout_s!r}")
    registry = _registry(tools)
    outcomes: list[ToolOutcome | None] = [None] * len(calls)

    async def run_into_slot(index: int, call: ToolCall) -> None:
        outcomes[index] = await _run_one(registry, call, default_timeout_s)

    async with anyio.create_task_group() as group:
        for index, call in enumerate(calls):
            group.start_soon(run_into_slot, index, call)
    return [outcome for outcome in outcomes if outcome is not None]


def _registry(tools: Sequence[Tool]) -> dict[str, Tool]:
    """Tools by name; two tools with one name are a UserError."""
    registry: dict[str, Tool] = {}
    for candidate in tools:
        if not isinstance(candidate, Tool):
            raise UserError(f"{candidate!r} is not a Tool; decorate it with @tool")
        if candidate.name in registry:
            raise UserError(
                f"two tools are named {candidate.name!r}; give one another name with @tool(name=...)"
            )
        registry[candidate.name] = candidate
    return registry


async def _run_one(registry: dict[str, Tool], call: ToolCall, default_timeout_s: float) -> ToolOutcome:
    """One call from lookup to text; every failure but cancellation becomes an error outcome."""
    started = time.perf_counter()

    def outcome(content: str, is_error: bool, max_chars: int | None) -> ToolOutcome:
        capped = truncate_text(content, max_chars)
        return ToolOutcome(call, capped, is_error, time.perf_counter() - started)

    tool = registry.get(call.name)
    if tool is None:
        return outcome(_unknown_tool_text(call.name, registry), True, DEFAULT_MAX_RESULT_CHARS)
    try:
        validated = tool.validate_arguments(call.arguments)
    except ValidationError as error:
        return outcome(_invalid_arguments_text(tool.name, error), True, tool.max_result_chars)

    timeout_s = tool.timeout_s if tool.timeout_s is not None else default_timeout_s
    with anyio.move_on_after(timeout_s) as deadline:
        try:
            content = await tool.call_validated(validated)
        except ToolResultNotText as error:  # the tool ran; its result could not be sent
            logger.warning("tool %r returned a result with no text form: %s", tool.name, error)
            return outcome(f"error: tool {tool.name!r} ran, but its result could not be turned into text: {error}",
                           True, tool.max_result_chars)
        except Exception as error:  # a tool failure is a result for the model, not our crash
            logger.info("tool %r raised %s", tool.name, type(error).__name__, exc_info=error)
            return outcome(_exception_text(tool.name, error), True, tool.max_result_chars)
    if deadline.cancelled_caught:
        logger.info("tool %r timed out after %s s", tool.name, timeout_s)
        return outcome(f"error: tool {tool.name!r} timed out after {timeout_s} s", True, None)
    return outcome(content, False, None)


def _unknown_tool_text(name: str, registry: dict[str, Tool]) -> str:
    """``error: unknown tool 'foo'; available tools: add, clock``."""
    available = ", ".join(sorted(registry)) or "none"
    return f"error: unknown tool {name!r}; available tools: {available}"


def _invalid_arguments_text(tool_name: str, error: ValidationError) -> str:
    """``error: invalid arguments for 'add': b: Input should be a valid integer (got 'x')``."""
    problems = describe_problems(error.errors(), root="arguments", show_input=True)
    return f"error: invalid arguments for {tool_name!r}: " + problems


def _exception_text(tool_name: str, error: Exception) -> str:
    """``error: tool 'calc' raised ZeroDivisionError: division by zero``."""
    detail = f": {error}" if str(error) else ""
    return f"error: tool {tool_name!r} raised {type(error).__name__}{detail}"
