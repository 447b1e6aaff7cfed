"""An ``Agent`` to and from its stored row: instructions, tools by name, settings, policy by class.

::

    settings = agent_settings(agent)           # what the row keeps besides name, instructions, tools
    record = await store.get_agent("helper")
    agent = agent_from_record(record)          # built-in tools and policies only

``Runtime.resume`` uses this for agents it was not given. A tool that is not built in (see
``BUILTIN_TOOLS``) cannot be rebuilt from a name: ``UserError`` says to pass the Agent itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from agentkv.agent import Agent
from agentkv.engine.base import GenerationConfig
from agentkv.errors import UserError
from agentkv.memory.records import AgentRecord
from agentkv.policies import (
    ContextPolicy,
    SlidingWindow,
    SummarizeAndReprefill,
    Truncation,
)
from agentkv.tools import Tool, calculator, clock

BUILTIN_TOOLS: Mapping[str, Tool] = {t.name: t for t in (calculator, clock)}
"""The tools a stored agent may name and still be rebuilt: ``agentkv.tools.builtin``."""

BUILTIN_POLICIES: Mapping[str, Callable[[], ContextPolicy]] = {
    "Truncation": Truncation,
    "SlidingWindow": SlidingWindow,
    "SummarizeAndReprefill": SummarizeAndReprefill,
}
"""Stored policy class names → the built-in policy class (instantiated with its defaults)."""

_PLAIN_FIELDS = (
    "tool_choice",
    "max_model_calls",
    "max_prompt_len",
    "min_response_len",
    "truncate_oversized_messages",
    "constrain_tool_calls",
    "parallel_tool_calls",
    "tool_timeout_s",
    "past_reasoning",
)
"""Stored settings copied to the ``Agent`` field of the same name (``agent_settings``)."""

def agent_settings(agent: Agent) -> dict[str, Any]:
    """The settings a stored agent row keeps (``agent_from_record`` reads them back):
    ``agent_settings(agent)["max_model_calls"]``."""
    return {
        "generation": agent.generation.model_dump(mode="json"),
        "tool_choice": agent.tool_choice,
        "max_model_calls": agent.max_model_calls,
        "max_prompt_len": agent.max_prompt_len,
        "min_response_len": agent.min_response_len,
        "truncate_oversized_messages": agent.truncate_oversized_messages,
        "constrain_tool_calls": agent.constrain_tool_calls,
        "parallel_tool_calls": agent.parallel_tool_calls,
        "tool_timeout_s": agent.tool_timeout_s,
        "past_reasoning": agent.past_reasoning,
        "policy": type(agent.policy).__name__ if agent.policy is not None else None,
        "output_schema": agent.output_spec.schema if agent.output_spec is not None else None,
        **agent.settings,
    }


_RENAMED_FIELDS = {"max_turns": "max_model_calls"}
"""Keys rows written before a rename carry → the field's name now."""

_KNOWN_KEYS = frozenset({*_PLAIN_FIELDS, *_RENAMED_FIELDS, "generation", "policy", "output_schema"})

_HOW_TO_PASS = ("pass the Agent itself: Runtime(engine, store, agents=[agent]) or "
                "runtime.resume(conversation_id, agent)")


def agent_from_record(record: AgentRecord) -> Agent:
    """The ``Agent`` the record describes; ``UserError`` for a tool or policy it cannot rebuild.

    Settings missing from an older row keep the ``Agent`` defaults; keys the runtime did not
    write itself go back into ``Agent.settings``.
    """
    stored = dict(record.settings)
    for old, new in _RENAMED_FIELDS.items():
        if old in stored:
            stored.setdefault(new, stored[old])
    fields: dict[str, Any] = {key: stored[key] for key in _PLAIN_FIELDS if key in stored}
    if stored.get("generation") is not None:
        fields["generation"] = GenerationConfig.model_validate(stored["generation"])
    if stored.get("output_schema") is not None:  # a pydantic output_type comes back as its schema (dicts)
        fields["output_type"] = stored["output_schema"]
    return Agent(
        name=record.name,
        instructions=record.instructions,
        tools=tuple(builtin_tool(record.name, name) for name in record.tool_names),
        policy=builtin_policy(record.name, stored.get("policy")),
        settings={k: v for k, v in stored.items() if k not in _KNOWN_KEYS},
        **fields,
    )


def builtin_tool(agent_name: str, tool_name: str) -> Tool:
    """The built-in tool called ``tool_name``; ``UserError`` naming the agent and the tool if none."""
    try:
        return BUILTIN_TOOLS[tool_name]
    except KeyError:
        raise UserError(
            f"agent {agent_name!r} uses the tool {tool_name!r}, which is not built in "
            f"(built-in: {', '.join(sorted(BUILTIN_TOOLS))}), so it cannot be rebuilt from the "
            f"store; {_HOW_TO_PASS}"
        ) from None


def builtin_policy(agent_name: str, class_name: str | None) -> ContextPolicy | None:
    """A default instance of the stored policy class; None for none; ``UserError`` if unknown."""
    if class_name is None:
        return None
    try:
        return BUILTIN_POLICIES[class_name]()
    except KeyError:
        raise UserError(
            f"agent {agent_name!r} uses the context policy {class_name!r}, which is not built in "
            f"(built-in: {', '.join(BUILTIN_POLICIES)}); {_HOW_TO_PASS}"
        ) from None
