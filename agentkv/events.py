"""Typed stream events of an agent run: one small dataclass per kind, one union for all.

::

    async for event in runtime.run_stream(conversation, "hi"):
        if event.type == "text_delta":
            print(event.text, end="")
        elif event.type == "reasoning_delta":   # a reasoning model thinking
            print(event.text, end="", file=sys.stderr)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Union

from agentkv.chat.messages import ToolCall
from agentkv.engine.base import GenerationMetrics, TokenLogprob

if TYPE_CHECKING:
    from agentkv.observe.cache_breaks import CacheBreak
    from agentkv.observe.self_check import SelfCheckResult
    from agentkv.result import RunResult


@dataclass(frozen=True)
class TextDelta:
    """Assistant text as it is generated (tool-call markup is not streamed)."""

    text: str
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``GenerationConfig.logprobs``: the tokens behind ``text`` (those of hidden text left out)."""
    type: Literal["text_delta"] = "text_delta"


@dataclass(frozen=True)
class ReasoningDelta:
    """A reasoning model's thinking as it is generated (the ``<think>`` block's inside, never
    part of ``TextDelta`` text nor of the answer)."""

    text: str
    type: Literal["reasoning_delta"] = "reasoning_delta"


@dataclass(frozen=True)
class ToolCalled:
    """The model called a tool."""

    call: ToolCall
    type: Literal["tool_called"] = "tool_called"


@dataclass(frozen=True)
class ToolReturned:
    """A tool returned (or failed; ``is_error``)."""

    call: ToolCall
    content: str
    is_error: bool
    duration_s: float
    type: Literal["tool_returned"] = "tool_returned"


@dataclass(frozen=True)
class CacheBroken:
    """A model call reuses less KV than its conversation held: where, in what, and why
    (``agentkv.observe.cache_breaks``). Comes before the call's text."""

    call_index: int
    """0-based index of the model call within the run."""
    cache_break: CacheBreak
    type: Literal["cache_broken"] = "cache_broken"


@dataclass(frozen=True)
class SelfCheckFailed:
    """A checked call's cached KV gave logits a fresh prefill does not (``agentkv.observe.self_check``):
    the conversation, the figures, and the operations on it since the last check, to reproduce it."""

    conversation_id: str
    result: SelfCheckResult
    operations: tuple[str, ...]
    type: Literal["self_check_failed"] = "self_check_failed"


@dataclass(frozen=True)
class ApprovalRequired:
    """The run stops: these calls wait for a person's approval (``runtime.approve`` / ``reject``)."""

    calls: tuple[ToolCall, ...]
    type: Literal["approval_required"] = "approval_required"


@dataclass(frozen=True)
class ModelCallFinished:
    """What one model call cost and reused."""

    call_index: int
    """0-based index of the model call within the run."""
    metrics: GenerationMetrics
    type: Literal["model_call_finished"] = "model_call_finished"


@dataclass(frozen=True)
class ContextCompacted:
    """A context-window policy removed messages from the window."""

    policy: str
    """The agent's policy (``"sliding_window"``…), also when it fell back."""
    tokens_before: int
    tokens_after: int
    messages_removed: int
    cost_ms: float
    fallback: str | None = None
    """``"truncation"`` when the policy could not do its own kind of compaction and truncated."""
    fallback_reason: str | None = None
    """Why it fell back (e.g. the model's keys fit no RoPE rotation), for logs and users."""
    type: Literal["context_compacted"] = "context_compacted"


@dataclass(frozen=True)
class RunFinished:
    """The run ended with a final answer."""

    result: RunResult
    type: Literal["run_finished"] = "run_finished"


RunEvent = Union[TextDelta, ReasoningDelta, ToolCalled, ToolReturned, ModelCallFinished, ContextCompacted, CacheBroken,
                 SelfCheckFailed, ApprovalRequired, RunFinished]
