"""Chat messages as pydantic models: what users, assistants and tools say.

``Message.user("hi")``, ``Message.assistant("2", tool_calls=[ToolCall(name="calc", arguments={"expr": "1+1"})])``,
``Message.tool("2", tool_call_id=call.id, name="calc")``. Assistant messages may carry the
exact ``token_ids`` the model generated, so re-rendering them never re-tokenises.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentkv.chat.surrogates import replace_lone_surrogates

Role = Literal["system", "user", "assistant", "tool"]


def new_call_id() -> str:
    """A short unique id for a tool call."""
    return "call_" + uuid.uuid4().hex[:12]


class ToolCall(BaseModel):
    """One tool call the model made."""

    model_config = ConfigDict(frozen=True)

    id: str = Field(default_factory=new_call_id)
    """Links the call to its result message (``Message.tool_call_id``)."""
    name: str
    """The tool's name."""
    arguments: dict[str, Any] = Field(default_factory=dict)
    """Arguments as parsed JSON (validated later against the tool's schema)."""

    _utf8_only = field_validator("name", "arguments")(replace_lone_surrogates)  # NOTE: UTF-8 can hold the text


class Message(BaseModel):
    """One chat message."""

    model_config = ConfigDict(frozen=True)

    role: Role
    """Who speaks: "system" (instructions), "user", "assistant" (the model) or "tool" (a tool's result)."""
    content: str = ""
    """The message's text: for an assistant message the answer without tool-call markup or
    thinking ("" when it only called tools); for a tool message the result the model reads."""
    tool_calls: tuple[ToolCall, ...] = ()
    """Calls made in an assistant message (empty otherwise)."""
    tool_call_id: str | None = None
    """For a tool result: the id of the call it answers; None on other messages."""
    name: str | None = None
    """For a tool result: the tool's name; None on other messages."""
    token_ids: tuple[int, ...] | None = None
    """For an assistant message the model generated: every id it generated (thinking, text, tool-call
    markup, and the stop token when one ended it), rendered verbatim so the prompt's tokens are the
    KV's. None on other messages, and on an assistant message whose broken tool-call markup was
    dropped (it is rendered from ``content``)."""
    reasoning: str | None = None
    """For an assistant message of a reasoning model: its thinking (the ``<think>`` block's
    inside), kept out of ``content``; None when it wrote none."""

    _utf8_only = field_validator("content", "name", "reasoning")(replace_lone_surrogates)  # NOTE: UTF-8 holds it

    @classmethod
    def system(cls, content: str) -> Message:
        """``Message.system("Answer in French.")``."""
        return cls(role="system", content=content)

    @classmethod
    def user(cls, content: str) -> Message:
        """``Message.user("What is 17 * 23?")``."""
        return cls(role="user", content=content)

    @classmethod
    def assistant(
        cls,
        content: str = "",
        *,
        tool_calls: tuple[ToolCall, ...] | list[ToolCall] = (),
        token_ids: tuple[int, ...] | list[int] | None = None,
        reasoning: str | None = None,
    ) -> Message:
        """``Message.assistant("42", reasoning="6 * 7")``."""
        return cls(
            role="assistant",
            content=content,
            tool_calls=tuple(tool_calls),
            token_ids=tuple(token_ids) if token_ids is not None else None,
            reasoning=reasoning,
        )

    @classmethod
    def tool(cls, content: str, *, tool_call_id: str, name: str) -> Message:
        """The result of a call, for the model: ``Message.tool("391", tool_call_id=call.id, name="calc")``."""
        return cls(role="tool", content=content, tool_call_id=tool_call_id, name=name)

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat-completions message dict (for export)."""
        import json

        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls and not self.content:
            out["content"] = None  # as OpenAI sends an assistant turn that only calls tools
        if self.tool_calls:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning  # NOTE: vLLM's / DeepSeek's field
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            out["name"] = self.name
        return out


def pending_tool_calls(messages: Sequence[Message]) -> dict[str, ToolCall]:
    """Tool calls in ``messages`` that no tool message answers yet, by id, in call order."""
    answered = {m.tool_call_id for m in messages if m.role == "tool"}
    return {c.id: c for m in messages if m.role == "assistant" for c in m.tool_calls if c.id not in answered}
