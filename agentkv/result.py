"""RunResult: what ``Runner.run`` returns — the final text, the calls made, the cost of each step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from agentkv.chat.messages import Message, ToolCall
from agentkv.engine.base import GenerationMetrics

FinishReason = Literal["stop", "length", "tool_call_cut", "tool_call_invalid", "max_turns"]
"""Why a run ended: "stop" (the model finished its answer), "length" (the answer was cut by
``max_new_tokens``), "tool_call_cut" (a tool call was still cut by the token limit after one
retry with room for it), "tool_call_invalid" (the model wrote tool-call markup that does not
parse), "max_turns" (``MaxTurnsExceeded.result``)."""


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run (one user input, any number of model calls)."""

    session_id: str
    final_text: str
    """The last assistant message's text."""
    new_messages: tuple[Message, ...]
    """Messages this run added (user input, assistant turns, tool results)."""
    tool_calls: tuple[ToolCall, ...]
    """Every tool call made, in order."""
    step_metrics: tuple[GenerationMetrics, ...]
    """One entry per model call."""
    finish_reason: FinishReason = "stop"
    """Why the run ended; ``final_text`` never holds tool-call markup, whatever the reason."""

    @property
    def prefilled_tokens(self) -> int:
        """Tokens run through the model across all steps (excluding decoding)."""
        return sum(m.prefilled_tokens for m in self.step_metrics)
