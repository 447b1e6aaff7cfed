"""RunResult: what ``Runner.run`` returns — the final text, the calls made, the cost of each step."""

from __future__ import annotations

from dataclasses import dataclass

from agentkv.chat.messages import Message, ToolCall
from agentkv.engine.base import GenerationMetrics


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

    @property
    def prefilled_tokens(self) -> int:
        """Tokens run through the model across all steps (excluding decoding)."""
        return sum(m.prefilled_tokens for m in self.step_metrics)
