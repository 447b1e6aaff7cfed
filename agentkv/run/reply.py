"""What one model call amounts to — an answer, tool calls, or a broken call — read from its
generation: ``reply = read_reply(agent, result)``."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.agent import Agent
from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import parse_tool_calls
from agentkv.engine.base import GenerationResult
from agentkv.result import FinishReason


@dataclass(frozen=True)
class Reply:
    """One model call read as an answer, tool calls, or a broken call:
    ``Reply("tool_calls", "", (call,))``."""

    finish: FinishReason
    content: str
    """The text outside any tool-call markup."""
    calls: tuple[ToolCall, ...] = ()


def read_reply(agent: Agent, result: GenerationResult) -> Reply:
    """Sort one generation into an answer, tool calls, or a cut / invalid call:
    ``read_reply(agent, result).finish == "tool_calls"``."""
    cut = result.finish_reason == "length"
    if not agent.tools or agent.tool_choice == "none":
        return Reply("length" if cut else "stop", result.text)
    parsed = parse_tool_calls(result.text)
    if parsed.truncated:  # NOTE: with calls before it too: the cut call is retried, never dropped
        return Reply("tool_call_cut" if cut else "tool_call_invalid", parsed.content)
    if parsed.tool_calls:
        return Reply("tool_calls", parsed.content, parsed.tool_calls)
    if parsed.errors:
        return Reply("tool_call_cut" if cut else "tool_call_invalid", parsed.content)
    return Reply("length" if cut else "stop", parsed.content)
