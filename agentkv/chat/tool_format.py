"""What a tool-call format is (how one model family writes calls, reads them back, and is forced
to write them; one ``ToolCallFormat`` object per format) and the Hermes format, the fallback::

    fmt = detect_tool_format(tokenizer.chat_template, vocabulary)   # e.g. HERMES
    text = fmt.format_calls([ToolCall(name="clock")])               # what the template renders
    parsed = fmt.parse(text)                                        # ParsedOutput, never raises
    constraint = factory(fmt.grammar(tools, "required"))
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from agentkv.chat import toolcalls
from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import ParsedOutput


class ToolCallFormat(ABC):
    """One family's tool-call text: its writer, parser, grammar and prompt instructions."""

    name: str
    """The format's name (``"hermes"``, ``"llama3_json"``, ``"mistral"``, ``"phi4_mini"``)."""
    open_tag: str
    """The text that starts the calls of an answer: what the stream filter hides from."""

    @abstractmethod
    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """The exact text the family's template renders for an assistant message's ``calls``
        (the grammar makes the model write exactly this):
        ``fmt.format_calls([ToolCall(name="clock")])``."""

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """Split a model's answer into content, calls and error texts for the model; never
        raises: ``fmt.parse(result.text).tool_calls``."""

    @abstractmethod
    def grammar(
        self,
        tools: Sequence[dict[str, Any]],
        tool_choice: str,
        *,
        max_string_length: int = 200,
        max_items: int = 16,
        parallel: bool = True,
        max_calls: int = 4,
        answer_schema: dict[str, Any] | None = None,
    ) -> str:
        """An llguidance Lark grammar for the whole answer under ``tool_choice`` (``"required"``,
        ``"auto"``: calls or text that never holds ``open_tag``, or a tool's name), with the
        semantics of ``toolcalls.tool_call_grammar``: ``fmt.grammar(tools, "auto")``."""

    @abstractmethod
    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """The system text listing ``tools`` and how to call them, for a template that cannot
        render tools itself: ``fmt.instructions([calculator.schema_for_prompt()])``."""

    def call_id(self, call_id: str) -> str:
        """The id the format writes for a call (and its tool result) whose agentkv id is
        ``call_id``; the same id by default: ``fmt.call_id(call.id)``."""
        return call_id

    def __repr__(self) -> str:
        return f"<ToolCallFormat {self.name}>"


class HermesFormat(ToolCallFormat):
    """Qwen 2.5 / Qwen 3 and the fallback: ``<tool_call>\\n{json}\\n</tool_call>`` blocks, one per
    call, separated by newlines (``agentkv.chat.toolcalls`` does the work)."""

    name = "hermes"
    open_tag = toolcalls.TOOL_CALL_OPEN

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """``HERMES.format_calls([ToolCall(name="clock")])``."""
        return toolcalls.format_tool_calls(calls)

    def parse(self, text: str) -> ParsedOutput:
        """``HERMES.parse('<tool_call>\\n{"name": "clock", "arguments": {}}\\n</tool_call>')``."""
        return toolcalls.parse_tool_calls(text)

    def grammar(
        self,
        tools: Sequence[dict[str, Any]],
        tool_choice: str,
        *,
        max_string_length: int = 200,
        max_items: int = 16,
        parallel: bool = True,
        max_calls: int = 4,
        answer_schema: dict[str, Any] | None = None,
    ) -> str:
        """``toolcalls.tool_call_grammar`` itself: ``HERMES.grammar(tools, "required")``."""
        return toolcalls.tool_call_grammar(
            tools, tool_choice, max_string_length=max_string_length, max_items=max_items,
            parallel=parallel, max_calls=max_calls, answer_schema=answer_schema,
        )

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """``HERMES.instructions([calculator.schema_for_prompt()])``."""
        return toolcalls.tools_instructions(tools)


HERMES = HermesFormat()
"""The Hermes format: Qwen's native one, and what every model without its own gets."""
