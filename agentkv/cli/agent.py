"""The agent a CLI chat runs: the stored one, the CLI's default, or either shaped by options.

::

    options = AgentOptions(system="Be terse.", temperature=0.7)
    agent, changes = await resolve_agent(store, "assistant", options)

A stored agent is never silently redefined: options that ask for other instructions or tools
than the stored agent's raise ``AgentClash``; options the user leaves out keep the stored values.
Without ``--agent``, ``--tools`` and ``--system`` pick a variant of the CLI's default agent with
a name of its own (``default_agent_name``), so what one chat asked for never sticks to the next.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypedDict

from pydantic import ValidationError

from agentkv.agent import Agent
from agentkv.engine.base import GenerationConfig
from agentkv.errors import AgentNotFound, UserError
from agentkv.memory import Store
from agentkv.memory.records import AgentRecord
from agentkv.policies import ContextPolicy, SlidingWindow, SummarizeAndReprefill, Truncation
from agentkv.runtime.stored_agent import BUILTIN_TOOLS, agent_from_record
from agentkv.tools import Tool


class AgentChanges(TypedDict, total=False):
    """The ``Agent`` fields the CLI's options may change: ``dataclasses.replace(agent, **changes)``."""

    instructions: str | None
    tools: Sequence[Tool]
    tool_choice: str
    parallel_tool_calls: bool
    generation: GenerationConfig
    policy: ContextPolicy
    max_prompt_len: int
    min_response_len: int


DEFAULT_AGENT = "assistant"
DEFAULT_INSTRUCTIONS = "You are a helpful assistant. Answer briefly."
CLI_TOOLS: tuple[Tool, ...] = tuple(BUILTIN_TOOLS.values())
"""What ``--tools`` gives the agent: every built-in tool."""
TOOL_RESULT_ECHO = "<tool_response>"
"""What the default model writes after a tool result: it wraps the result in the markup it was
trained on instead of answering (measured: every time, on each plugin profile)."""
TOOLS_SETTINGS: AgentChanges = {"tool_choice": "required", "parallel_tool_calls": False}
"""How ``--tools`` runs: the default model (135M) never chose a tool by itself (it looped
"17 * 23 = 17 * 23 = …"), so each message's first model call is grammar-forced to make one tool
call; the answer's model call stops at ``TOOL_RESULT_ECHO``, so the tool's result is the answer."""


class PolicyName(str, Enum):
    """``--policy`` values."""

    truncation = "truncation"
    sliding = "sliding"
    summarize = "summarize"


POLICIES: dict[PolicyName, type[ContextPolicy]] = {
    PolicyName.truncation: Truncation,
    PolicyName.sliding: SlidingWindow,
    PolicyName.summarize: SummarizeAndReprefill,
}


class CLIUsageError(UserError):
    """A command line that cannot run as given; the CLI exits with code 2 and changes nothing."""

    exit_code = 2


class AgentClash(CLIUsageError):
    """The command line asks for an agent other than the stored agent of the same name."""


@dataclass(frozen=True)
class AgentOptions:
    """The agent-shaping options of ``agentkv chat``; None means "not given"."""

    system: str | None = None
    tools: bool | None = None
    """True: the built-in tools; False: none (``--no-tools``)."""
    policy: PolicyName | None = None
    max_prompt_len: int | None = None
    max_new_tokens: int | None = None
    """Also the room kept free for the answer (``Agent.min_response_len``)."""
    temperature: float | None = None

    @property
    def given(self) -> bool:
        """True when at least one option was given."""
        return any(getattr(self, f.name) is not None for f in dataclasses.fields(self))

    def check(self) -> None:
        """``CLIUsageError`` for values no model context could make valid."""
        if self.temperature is not None and not math.isfinite(self.temperature):
            raise CLIUsageError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.system is not None and not self.system.strip():
            raise CLIUsageError("--system must not be empty; leave it out for the default instructions")


def default_agent_name(options: AgentOptions) -> str:
    """The CLI's default agent for these options: ``assistant``; with ``--tools``
    ``assistant+tools``; with ``--system`` a suffix from a hash of the instructions
    (``assistant+system-1a2b3c4d``). Each variant is stored as itself and its conversations resume
    with it; ``--no-tools`` and no ``--system`` are the plain default."""
    name = DEFAULT_AGENT
    if options.system is not None and options.system != DEFAULT_INSTRUCTIONS:
        name += "+system-" + hashlib.sha256(options.system.encode()).hexdigest()[:8]
    if options.tools:
        name += "+tools"
    return name


async def resolve_agent(store: Store, name: str, options: AgentOptions) -> tuple[Agent, list[str]]:
    """The agent to run and the stored settings the options change (for a notice).

    No stored agent: the CLI default shaped by the options. A stored one: as is without options;
    with options, ``AgentClash`` if they ask for other instructions or tools, else the stored
    agent with the given options applied.
    """
    options.check()
    try:
        record: AgentRecord | None = await store.get_agent(name)
    except AgentNotFound:
        record = None
    if record is None:
        return apply_options(Agent(name=name, instructions=DEFAULT_INSTRUCTIONS), options), []
    if not options.given:
        return agent_from_record(record), []
    refuse_clash(record, options)
    base = agent_from_record(record)
    agent = apply_options(base, options)
    return agent, setting_changes(base, agent)


def refuse_clash(record: AgentRecord, options: AgentOptions) -> None:
    """``AgentClash`` when the options' instructions or tools differ from the stored agent's."""
    clashes = []
    if options.system is not None and options.system != record.instructions:
        clashes.append(f"instructions {_short(record.instructions)} (--system asks for {_short(options.system)})")
    if options.tools is not None:
        wanted = {t.name for t in CLI_TOOLS} if options.tools else set()
        if wanted != set(record.tool_names):
            flag = "--tools" if options.tools else "--no-tools"
            clashes.append(f"tools {sorted(record.tool_names)} ({flag} asks for {sorted(wanted)})")
    if clashes:
        raise AgentClash(
            f"a stored agent named {record.name!r} has other " + " and ".join(clashes)
            + "; nothing was changed. Use --agent with a new name for a new agent, or leave out "
            "--system/--tools to chat with the stored agent as it is"
        )


def apply_options(base: Agent, options: AgentOptions) -> Agent:
    """``base`` with the given options applied (``CLIUsageError`` for an invalid combination)."""
    changes: AgentChanges = {}
    config = base.generation
    if options.system is not None:
        changes["instructions"] = options.system
    if options.tools is not None:
        same = {t.name for t in base.tools} == {t.name for t in CLI_TOOLS}
        changes["tools"] = (base.tools if same else CLI_TOOLS) if options.tools else ()
        if options.tools and not same:
            changes.update(TOOLS_SETTINGS)
            config = config.model_copy(update={"stop_strings": (*config.stop_strings, TOOL_RESULT_ECHO)})
            changes["generation"] = config
    if options.policy is not None:
        changes["policy"] = POLICIES[options.policy]()
    if options.max_prompt_len is not None:
        changes["max_prompt_len"] = options.max_prompt_len
    if options.max_new_tokens is not None:
        changes["min_response_len"] = options.max_new_tokens
    generation = {k: v for k, v in (("max_new_tokens", options.max_new_tokens),
                                    ("temperature", options.temperature)) if v is not None}
    try:
        if generation:
            changes["generation"] = GenerationConfig.model_validate({**config.model_dump(), **generation})
        agent = dataclasses.replace(base, **changes)
    except (ValidationError, UserError) as error:
        raise CLIUsageError(f"these options do not make a valid agent: {error}") from None
    check_window(agent)
    return agent


def check_window(agent: Agent, context_len: int | None = None) -> None:
    """``CLIUsageError`` when the prompt budget leaves no room (``context_len``: the model's)."""
    if agent.max_prompt_len is None:
        return
    if context_len is not None and agent.max_prompt_len > context_len:
        raise CLIUsageError(
            f"max_prompt_len {agent.max_prompt_len} exceeds the model's context of {context_len} "
            f"tokens; pass --max-prompt-len {context_len} or less")
    if agent.max_prompt_len <= agent.min_response_len:
        raise CLIUsageError(
            f"max_prompt_len {agent.max_prompt_len} leaves no room for the prompt: it must exceed "
            f"the {agent.min_response_len} tokens kept for the answer; raise --max-prompt-len or "
            f"lower --max-new-tokens")


def setting_changes(base: Agent, agent: Agent) -> list[str]:
    """Human-readable ``name old → new`` for the settings ``agent`` changes from ``base``."""
    pairs = [
        ("max_new_tokens", base.generation.max_new_tokens, agent.generation.max_new_tokens),
        ("temperature", base.generation.temperature, agent.generation.temperature),
        ("max_prompt_len", base.max_prompt_len, agent.max_prompt_len),
        ("min_response_len", base.min_response_len, agent.min_response_len),
        ("policy", _policy_name(base.policy), _policy_name(agent.policy)),
    ]
    return [f"{name} {old} → {new}" for name, old, new in pairs if old != new]


def _policy_name(policy: ContextPolicy | None) -> str | None:
    return None if policy is None else type(policy).__name__


def _short(text: str | None, limit: int = 60) -> str:
    if text is None:
        return "(none: the template's default)"
    return repr(text if len(text) <= limit else text[: limit - 1] + "…")
