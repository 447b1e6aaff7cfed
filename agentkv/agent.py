"""Agent: what a user declares — name, instructions, tools, generation settings, window policy.

::

    from agentkv import Agent, tool

    @tool
    def add(a: int, b: int) -> int:
        "Add two integers."
        return a + b

    agent = Agent(name="math", instructions="Use tools for arithmetic.", tools=[add])
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import ValidationError

from agentkv.chat.structured_output import OutputSpec
from agentkv.engine.base import GenerationConfig
from agentkv.errors import UserError
from agentkv.tools import Tool, tool

if TYPE_CHECKING:
    from agentkv.chat.messages import ToolCall
    from agentkv.policies.protocol import ContextPolicy

TOOL_CHOICES = ("auto", "required", "none")


@dataclass(frozen=True)
class Agent:
    """An agent definition (immutable; share one across many conversations)."""

    name: str
    """Unique name; conversations and stored rows refer to it."""
    instructions: str | None = "You are a helpful assistant."
    """The system prompt. None renders no system turn, so the chat template's own default system
    prompt applies (with tools, their text still needs one: it then carries only that)."""
    tools: Sequence[Tool] = ()
    """Tools the model may call; an agent only ever runs its own tools. A plain function is
    wrapped with ``@tool`` (its signature and docstring make the schema); a dict in OpenAI
    function format is a tool the caller executes (the run stops at its calls)."""
    generation: GenerationConfig = field(default_factory=lambda: GenerationConfig(max_new_tokens=256))
    """How the model picks tokens on every call of a run (a dict is turned into a
    ``GenerationConfig``: ``Agent(name="a", generation={"max_new_tokens": 64})``)."""
    tool_choice: str = "auto"
    """"auto" (text or a call), "required" (the first step must call a tool), "none" (no calls),
    or a tool's name (the first step must call that tool)."""
    max_model_calls: int = 10
    """Most model calls in one run; more raises ``MaxModelCallsExceeded``."""
    policy: ContextPolicy | None = None
    """Context-window policy applied when the prompt outgrows ``max_prompt_len``; None raises
    ``ContextOverflowError`` instead."""
    max_prompt_len: int | None = None
    """Prompt budget in tokens (default: the engine's context length)."""
    min_response_len: int = 256
    """Tokens reserved for the answer inside ``max_prompt_len``."""
    truncate_oversized_messages: bool = False
    """When one message alone overflows the prompt budget, cut its content (head and tail kept
    around a visible ``[… N tokens truncated …]`` marker) instead of raising
    ``ContextOverflowError``. Applies to user and tool messages; the stored original is kept."""
    constrain_tool_calls: bool = True
    """Decode tool calls under a grammar so they always parse (engines that support it)."""
    parallel_tool_calls: bool = True
    """The model may answer with several calls at once (run concurrently, results in call
    order), as OpenAI's ``parallel_tool_calls``; False: at most one call per model step."""
    tool_timeout_s: float = 30.0
    """Timeout for tools that set none."""
    needs_approval: Callable[[ToolCall], bool] | None = None
    """Picks the calls that wait for a person's approval before they run, besides those of
    ``@tool(requires_approval=True)`` tools: ``Agent(..., needs_approval=lambda call: call.name ==
    "pay" and call.arguments["amount"] > 100)`` (``agentkv.run.approvals``)."""
    output_type: Any = None
    """Structured final output: a pydantic model class or a JSON schema dict (an OpenAI
    ``response_format`` works too). The answer is decoded under the schema and parsed into
    ``RunResult.output``: ``Agent(name="geo", output_type=City)``. None: free text."""
    past_reasoning: Literal["auto", "shift", "reprefill"] = "auto"
    """What the KV does with a reasoning model's earlier thinking once its chat template leaves it
    out (Qwen3 shows only the answers of turns before the last user message): ``"shift"`` drops
    it by a span drop + RoPE shift (no re-prefill; the answers' KV was computed with the thinking
    in view, as after a sliding-window drop), ``"reprefill"`` re-reads everything after it (the KV
    then equals a fresh prefill). ``"auto"`` (the default) is ``"reprefill"`` on an engine whose
    numerics are exact (``open_engine(exact=True)``: bit-exact KV is what it promises) and
    ``"shift"`` on any other. A shifted KV is no longer captured into the prefix cache, as after
    any shift. Models whose KV cannot shift re-read either way."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Free-form settings stored with the agent."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.strip():
            raise UserError("Agent(name=...) must be a non-empty string")
        if self.instructions is not None and not isinstance(self.instructions, str):
            raise UserError(f"agent {self.name!r}: instructions must be a string, or None for no system turn "
                            f"(the chat template's default), got {type(self.instructions).__name__}")
        # NOTE: frozen dataclass: coerced values are set through object.__setattr__
        object.__setattr__(self, "generation", _generation_config(self.name, self.generation))
        object.__setattr__(self, "tools", tuple(_as_tool(self.name, t) for t in _tool_list(self.name, self.tools)))
        _check_types(self)
        _check_numbers(self)
        names = [t.name for t in self.tools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise UserError(f"agent {self.name!r} has two tools named {duplicates}; rename one")
        if self.tool_choice not in TOOL_CHOICES and self.tool_choice not in names:
            raise UserError(
                f"tool_choice={self.tool_choice!r} is neither auto/required/none nor one of the "
                f"agent's tools {names}"
            )
        if self.tool_choice != "auto" and self.tool_choice != "none" and not self.tools:
            raise UserError(f"tool_choice={self.tool_choice!r} needs at least one tool")
        _ = self.output_spec  # NOTE: a bad output_type is refused here, not at the first run

    @functools.cached_property
    def output_spec(self) -> OutputSpec | None:
        """The schema and parser of ``output_type`` (None without one): ``agent.output_spec.schema``."""
        return None if self.output_type is None else _output_spec(self.name, self.output_type)

    @property
    def external_tool_names(self) -> frozenset[str]:
        """Names of the tools the caller executes (made from raw schemas): a run stops at their calls."""
        return frozenset(t.name for t in self.tools if t.is_external)

    def max_prompt(self, context_len: int) -> int:
        """The longest prompt a model call may have on a model of ``context_len`` tokens."""
        return min(self.max_prompt_len or context_len, context_len)

    def prompt_budget(self, context_len: int) -> int:
        """What the prompt may use before an answer: ``max_prompt`` less ``min_response_len``."""
        return self.max_prompt(context_len) - self.min_response_len

    @property
    def tool_schemas(self) -> list[dict[str, Any]]:
        """The tools in OpenAI function format, for rendering and grammars."""
        return [t.schema_for_prompt() for t in self.tools]


def _output_spec(agent: str, value: Any) -> OutputSpec:
    try:
        return OutputSpec.of(value)
    except UserError as error:
        raise UserError(f"agent {agent!r}: {error}") from error


def _generation_config(agent: str, value: Any) -> GenerationConfig:
    """``value`` as a GenerationConfig (a dict is validated into one)."""
    if isinstance(value, GenerationConfig):
        return value
    if isinstance(value, dict):
        try:
            return GenerationConfig(**value)
        except ValidationError as error:
            raise UserError(f"agent {agent!r}: invalid generation settings: {error}") from error
    raise UserError(f"agent {agent!r}: generation must be a GenerationConfig or a dict, got {type(value).__name__}")


def _as_tool(agent: str, value: Any) -> Tool:
    """A ``Tool``; a plain function is wrapped with ``@tool``; anything else is refused."""
    if isinstance(value, Tool):
        return value
    if isinstance(value, Mapping):  # a raw OpenAI schema: the caller executes the tool
        return tool(value)
    if callable(value):
        function: Callable[..., Any] = value
        return tool(function)
    raise UserError(
        f"agent {agent!r}: tools must be functions, @tool-decorated functions or OpenAI tool schemas "
        f"(dicts), got {value!r} ({type(value).__name__})"
    )


def _tool_list(agent: str, value: Any) -> Sequence[Any]:
    """``value`` if it is a list (or tuple) of tools; one tool alone or anything else is refused."""
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return value
    raise UserError(f"agent {agent!r}: tools must be a list, e.g. Agent(..., tools=[add]), got {type(value).__name__}")


_FLAGS = ("truncate_oversized_messages", "constrain_tool_calls", "parallel_tool_calls")


def _check_types(agent: Agent) -> None:
    """Fields of the wrong kind, which would otherwise fail (or be read wrongly) mid-run."""
    from agentkv.policies.protocol import ContextPolicy

    where = f"agent {agent.name!r}"
    for name in _FLAGS:
        if not isinstance(getattr(agent, name), bool):
            raise UserError(f"{where}: {name} must be True or False, got {getattr(agent, name)!r}")
    if agent.policy is not None and (isinstance(agent.policy, type) or not isinstance(agent.policy, ContextPolicy)):
        raise UserError(f"{where}: policy must be a context policy object, e.g. policy=SlidingWindow() "
                        f"(from agentkv.policies import SlidingWindow, Truncation, SummarizeAndReprefill), "
                        f"or None; got {agent.policy!r}")
    if agent.needs_approval is not None and not callable(agent.needs_approval):
        raise UserError(f"{where}: needs_approval must be a function of a ToolCall returning True for the calls "
                        f"that wait for approval, e.g. needs_approval=lambda call: call.name == 'pay'; or None; "
                        f"got {agent.needs_approval!r}")
    if not isinstance(agent.settings, Mapping):
        raise UserError(f"{where}: settings must be a dict, got {type(agent.settings).__name__}")
    if agent.past_reasoning not in ("auto", "shift", "reprefill"):
        raise UserError(f"{where}: past_reasoning must be 'auto' (the default), 'shift' or 'reprefill', "
                        f"got {agent.past_reasoning!r}")
    if not isinstance(agent.tool_choice, str):
        raise UserError(f"{where}: tool_choice must be 'auto', 'required', 'none' or a tool's name, "
                        f"got {agent.tool_choice!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_numbers(agent: Agent) -> None:
    """Budgets and limits that would only fail later, at run time."""
    for name in ("max_model_calls", "min_response_len"):
        if not _is_int(getattr(agent, name)):
            raise UserError(f"{name} must be a whole number, got {getattr(agent, name)!r}")
    if agent.max_prompt_len is not None and not _is_int(agent.max_prompt_len):
        raise UserError(f"max_prompt_len must be a whole number of tokens or None, got {agent.max_prompt_len!r}")
    timeout = agent.tool_timeout_s
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not math.isfinite(timeout):
        raise UserError(f"tool_timeout_s must be a finite number of seconds > 0 (e.g. 30.0), got {timeout!r}")
    if agent.max_model_calls < 1:
        raise UserError(f"max_model_calls must be >= 1, got {agent.max_model_calls}")
    if agent.min_response_len < 0:
        raise UserError(f"min_response_len must be >= 0, got {agent.min_response_len}")
    if agent.tool_timeout_s <= 0:
        raise UserError(f"tool_timeout_s must be > 0 seconds, got {agent.tool_timeout_s}")
    if agent.max_prompt_len is not None and agent.max_prompt_len <= agent.min_response_len:
        raise UserError(
            f"max_prompt_len={agent.max_prompt_len} leaves no room for the prompt once "
            f"min_response_len={agent.min_response_len} tokens are reserved for the answer; raise "
            f"max_prompt_len or lower min_response_len (e.g. Agent(..., min_response_len="
            f"{max(1, agent.max_prompt_len // 4)}))"
        )
