"""What one model call amounts to — an answer, tool calls, or a broken call — read from its
generation: ``reply = read_reply(agent, result)``."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.agent import Agent
from agentkv.chat.messages import ToolCall
from agentkv.chat.reasoning import ReasoningTags, split_reasoning
from agentkv.chat.tool_formats import HERMES, ToolCallFormat
from agentkv.engine.generation import GenerationResult
from agentkv.result import FinishReason
from agentkv.run.call_settings import reasoning_tags_of, tool_format_of


@dataclass(frozen=True)
class Reply:
    """One model call read as an answer, tool calls, or a broken call:
    ``Reply("tool_calls", "", (call,))``."""

    finish: FinishReason
    content: str
    """The text outside any tool-call markup."""
    calls: tuple[ToolCall, ...] = ()
    reasoning: str | None = None
    """A reasoning model's thinking before the rest (``split_reasoning``); None: it wrote none."""


def read_reply(agent: Agent, result: GenerationResult, *, tool_format: ToolCallFormat = HERMES,
               reasoning_tags: ReasoningTags | None = None, renderer: object = None) -> Reply:
    """Sort one generation into an answer, tool calls (written in ``tool_format``), or a cut /
    invalid call; with ``reasoning_tags`` the leading thinking block is read first and only the
    rest is parsed (a call inside the thinking is no call). A conversation's ``renderer`` gives
    both (its model's): ``read_reply(agent, result, renderer=conversation.renderer).finish``."""
    if renderer is not None:
        tool_format, reasoning_tags = tool_format_of(renderer), reasoning_tags_of(renderer)
    cut = result.finish_reason == "length"
    reasoning, text = split_reasoning(result.text, reasoning_tags)
    if not agent.tools or agent.tool_choice == "none":
        return Reply("length" if cut else "stop", text, reasoning=reasoning)
    parsed = tool_format.parse(text)
    if parsed.truncated:  # NOTE: with calls before it too: the cut call is retried, never dropped
        return Reply("tool_call_cut" if cut else "tool_call_invalid", parsed.content, reasoning=reasoning)
    if parsed.tool_calls:
        return Reply("tool_calls", parsed.content, parsed.tool_calls, reasoning)
    if parsed.errors:
        return Reply("tool_call_cut" if cut else "tool_call_invalid", parsed.content, reasoning=reasoning)
    return Reply("length" if cut else "stop", parsed.content, reasoning=reasoning)
