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
from agentkv.engine.generation import GenerationMetrics, TokenLogprob

if TYPE_CHECKING:
    from agentkv.observe.cache_breaks import CacheBreak
    from agentkv.observe.self_check import SelfCheckResult
    from agentkv.result import RunResult


@dataclass(frozen=True)
class TextDelta:
    """Assistant text as it is generated (tool-call markup is not streamed)."""

    text: str
    """The new visible text of the answer (never empty): usually one token's, more when text held
    back (part of a UTF-8 character, a possible stop string or tool-call tag) is let through.
    Thinking and tool-call markup are left out; a cut tool call's retry streams nothing."""
    logprobs: tuple[TokenLogprob, ...] = ()
    """With ``GenerationConfig.logprobs``: the tokens behind ``text`` (those of hidden text left out);
    empty without it."""
    type: Literal["text_delta"] = "text_delta"
    """The discriminator of ``RunEvent``: always ``"text_delta"`` (``if event.type == "text_delta"``)."""


@dataclass(frozen=True)
class ReasoningDelta:
    """A reasoning model's thinking as it is generated (the ``<think>`` block's inside, never
    part of ``TextDelta`` text nor of the answer)."""

    text: str
    """The new thinking text (never empty), the ``<think>`` tags themselves left out. A model call's
    whole thinking is kept on its assistant message's ``reasoning`` (the last call's is also
    ``RunResult.reasoning``)."""
    type: Literal["reasoning_delta"] = "reasoning_delta"
    """The discriminator of ``RunEvent``: always ``"reasoning_delta"``."""


@dataclass(frozen=True)
class ToolCalled:
    """The model called a tool: announced just before the runtime runs it (all of a model call's
    calls first, then their ``ToolReturned``), or, for a tool the caller executes, after the
    runtime's own calls ran (no ``ToolReturned`` follows: the caller sends the result in its next
    run). A call that needs approval is announced once it is approved; a rejected one only gets its
    ``ToolReturned``."""

    call: ToolCall
    """The call as the model made it: its id, the tool's name and the parsed arguments (not yet
    validated against the tool's schema)."""
    type: Literal["tool_called"] = "tool_called"
    """The discriminator of ``RunEvent``: always ``"tool_called"``."""


@dataclass(frozen=True)
class ToolReturned:
    """A tool returned (or failed; ``is_error``), or a person rejected its call; its result is
    recorded in the conversation before this event."""

    call: ToolCall
    """The call this result answers (``call.id`` is the tool message's ``tool_call_id``)."""
    content: str
    """The result as the model reads it (the tool message's content): the tool's value as text,
    cut to the tool's ``max_result_chars`` (with a marker saying how much was cut); on a failure or
    a rejection, a text starting with ``"error: "`` that says what went wrong."""
    is_error: bool
    """True when the call failed (unknown tool, invalid arguments, the tool raised, timed out, or
    returned a value with no text form) or was rejected (``runtime.reject``); the run goes on either way."""
    duration_s: float
    """Wall-clock seconds from looking the tool up to its result (validation and the call
    included); 0.0 for a rejected call, which never ran."""
    type: Literal["tool_returned"] = "tool_returned"
    """The discriminator of ``RunEvent``: always ``"tool_returned"``."""


@dataclass(frozen=True)
class CacheBroken:
    """A model call reuses less KV than its conversation held: where, in what, and why
    (``agentkv.observe.cache_breaks``). Comes before the call's text."""

    call_index: int
    """0-based index of the model call within the run."""
    cache_break: CacheBreak
    """Where the prompt left the KV the conversation held, the tokens on both sides, and the cause
    (``cache_break.describe()`` gives one line). Also in ``RunResult.cache_breaks``."""
    type: Literal["cache_broken"] = "cache_broken"
    """The discriminator of ``RunEvent``: always ``"cache_broken"``."""


@dataclass(frozen=True)
class SelfCheckFailed:
    """A checked call's cached KV gave logits a fresh prefill does not (``agentkv.observe.self_check``):
    the conversation, the figures, and the operations on it since the last check, to reproduce it."""

    conversation_id: str
    """The id of the conversation whose KV failed the check (``Conversation.id``)."""
    result: SelfCheckResult
    """The check's figures: the model call's index, its prompt tokens, the max abs logit
    difference, the KL divergence, whether the argmax agreed, and the tolerance they broke."""
    operations: tuple[str, ...]
    """What happened to the conversation's KV since the previous check, oldest first, one line
    each (a resume or fork and the KV it restored, compactions, rewinds, each model call's reuse
    and any cache break, this call's last), to reproduce the failure."""
    type: Literal["self_check_failed"] = "self_check_failed"
    """The discriminator of ``RunEvent``: always ``"self_check_failed"``."""


@dataclass(frozen=True)
class ApprovalRequired:
    """The run stops: these calls wait for a person's approval (``runtime.approve`` / ``reject``).
    ``RunFinished`` follows, with ``finish_reason="approval_required"``."""

    calls: tuple[ToolCall, ...]
    """Every call in the conversation still waiting for approval, in call order (never empty);
    the same as the ``RunFinished`` result's ``pending_approvals``."""
    type: Literal["approval_required"] = "approval_required"
    """The discriminator of ``RunEvent``: always ``"approval_required"``."""


@dataclass(frozen=True)
class ModelCallFinished:
    """What one model call cost and reused."""

    call_index: int
    """0-based index of the model call within the run."""
    metrics: GenerationMetrics
    """The call's token counts (reused, from the prefix cache, prefilled, generated), its times in
    seconds (``ttft_s``, ``tpot_s``) and the KV it left (``kv_tokens``, ``kv_bytes``). For a tool
    call cut by the token limit and generated again, the retry's figures."""
    type: Literal["model_call_finished"] = "model_call_finished"
    """The discriminator of ``RunEvent``: always ``"model_call_finished"``."""


@dataclass(frozen=True)
class ContextCompacted:
    """A context-window policy compacted the window before a model call: the prompt had grown past
    the agent's budget (``max_prompt_len - min_response_len``)."""

    policy: str
    """The name of the agent's policy (``"truncation"``, ``"sliding_window"``,
    ``"summarize_and_reprefill"``, or a custom policy's), also when it fell back."""
    tokens_before: int
    """Tokens of the rendered prompt (system prompt, tool schemas, window and generation prompt)
    when the compaction began: over the budget."""
    tokens_after: int
    """Tokens of the rendered prompt once the compaction ended: within the budget (the built-in
    policies aim at their ``low_water`` fraction of it)."""
    messages_removed: int
    """Messages moved out of the window (still stored); a summary replaces them with one message.
    0 when only oversized messages were cut down (``Agent(truncate_oversized_messages=True)``)."""
    cost_ms: float
    """Wall-clock milliseconds the compaction took, any re-prefill it did (and a summary's
    generation) included."""
    fallback: str | None = None
    """``"truncation"`` when the policy could not do its own kind of compaction and truncated;
    None when it did its own."""
    fallback_reason: str | None = None
    """Why it fell back (e.g. the model's keys fit no RoPE rotation), for logs and users; None
    when it did not fall back."""
    type: Literal["context_compacted"] = "context_compacted"
    """The discriminator of ``RunEvent``: always ``"context_compacted"``."""


@dataclass(frozen=True)
class RunFinished:
    """The run ended: the last event of every run that did not raise — with the final answer, or
    stopped for calls the caller runs or a person approves (``result.finish_reason`` says which)."""

    result: RunResult
    """The run's result: what ``runtime.run`` returns for it."""
    type: Literal["run_finished"] = "run_finished"
    """The discriminator of ``RunEvent``: always ``"run_finished"``."""


RunEvent = Union[TextDelta, ReasoningDelta, ToolCalled, ToolReturned, ModelCallFinished, ContextCompacted, CacheBroken,
                 SelfCheckFailed, ApprovalRequired, RunFinished]
"""Any event ``runtime.run_stream`` yields; tell them apart by ``event.type`` (or ``isinstance``):
``async for event in runtime.run_stream(conversation, "hi"): ...``."""
