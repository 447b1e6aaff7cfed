"""RunResult: what a run returns — the final text, the calls made, the cost of each model call — and ResumeReport,
what a resume found."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from agentkv.chat.messages import Message, ToolCall
from agentkv.engine.generation import GenerationMetrics
from agentkv.observe.cache_breaks import CacheBreak
from agentkv.observe.self_check import SelfCheckResult

FinishReason = Literal["stop", "length", "tool_calls", "tool_call_cut", "tool_call_invalid", "output_invalid",
                       "max_model_calls", "approval_required"]
"""Why a run ended: "stop" (the model finished its answer), "length" (the answer was cut by
``max_new_tokens`` or the room left in the context), "tool_calls" (the model called tools the
caller executes: ``RunResult.pending_tool_calls``), "tool_call_cut" (a tool call was still cut by
the token limit after one retry with room for it; the complete calls before it are not run either:
the model call is reported whole, never partly), "tool_call_invalid" (the model wrote tool-call
markup that does not parse), "output_invalid" (with ``Agent(output_type=...)``: the answer did not
parse as that type; ``RunResult.output`` is None), "max_model_calls" (``MaxModelCallsExceeded.result``),
"approval_required" (calls wait for a person's decision: ``RunResult.pending_approvals``)."""


@dataclass(frozen=True)
class RunResult:
    """The outcome of one run (one user input, any number of model calls)."""

    conversation_id: str
    """The id of the conversation the run ran on (``Conversation.id``)."""
    final_text: str
    """The last assistant message's text (a reasoning model's thinking left out: ``reasoning``;
    tool-call markup left out); "" when the run ended on ``max_model_calls``."""
    new_messages: tuple[Message, ...]
    """Messages this run added to the conversation, in order (user input, assistant turns, tool
    results, rejections' results)."""
    tool_calls: tuple[ToolCall, ...]
    """Every tool call the model made in this run, in order (the runtime's tools, the caller's and
    those waiting for approval alike)."""
    call_metrics: tuple[GenerationMetrics, ...]
    """One entry per generation, in order: one per model call, plus one for each retry of a tool call
    cut by the token limit (the cut attempt comes first)."""
    finish_reason: FinishReason = "stop"
    """Why the run ended; ``final_text`` never holds tool-call markup, whatever the reason.
    "tool_calls": the model called tools the caller executes (``pending_tool_calls``)."""
    output: Any = None
    """With ``Agent(output_type=...)``: the final answer parsed (a model instance or a dict);
    None when the run did not end in a valid one (``finish_reason`` says why)."""
    pending_tool_calls: tuple[ToolCall, ...] = ()
    """Calls of caller-executed tools (made from raw schemas) waiting for results (empty unless
    ``finish_reason`` is "tool_calls" or "approval_required"): continue the run with
    ``runtime.run(conversation, [{"role": "tool", "tool_call_id": call.id, "content": ...}])``."""
    cache_breaks: tuple[CacheBreak | None, ...] = ()
    """One entry per entry of ``call_metrics``: where and why that generation reused less KV than
    its conversation held, None where it reused all of it."""
    self_checks: tuple[SelfCheckResult, ...] = ()
    """The calls of this run that self-check mode checked (``Runtime(self_check=...)``), passed or
    not, in order; empty with self-check mode off."""
    reasoning: str | None = None
    """A reasoning model's thinking before ``final_text`` (the last model call's ``<think>``
    block); None when it wrote none."""
    pending_approvals: tuple[ToolCall, ...] = ()
    """Calls waiting for a person's approval (``finish_reason="approval_required"``; else empty):
    continue with ``runtime.approve(conversation, call.id)`` or ``runtime.reject(conversation, call.id, reason)``."""

    @property
    def prefilled_tokens(self) -> int:
        """Tokens run through the model across all model calls (excluding decoding)."""
        return sum(m.prefilled_tokens for m in self.call_metrics)


@dataclass(frozen=True)
class ResumeReport:
    """What a resume found: the messages loaded and how the KV came back."""

    messages: int
    """Messages put back into the window (those of the stored window, a fork's shared ones included)."""
    restored_tokens: int
    """Tokens whose KV came from a snapshot (0: the next call re-prefills)."""
    skipped_snapshots: tuple[str, ...] = ()
    """Why snapshots were passed over (corrupt, another model, stale)."""
    interrupted_calls: int = 0
    """Tool calls a crash left without a result, now given an "interrupted" one."""
    restored_from: Mapping[str, int] = field(default_factory=dict)
    """Tokens of the restored KV each place gave: "host", "disk" or "s3" (the KV store's tiers, in
    whole blocks) and "snapshot" (a snapshot file or object: a tail, or a snapshot saved whole),
    counted before the KV was trimmed to what the history renders: ``{"disk": 320, "snapshot": 18}``."""
