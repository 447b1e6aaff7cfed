"""The agent loop: render → fit the window → generate → parse tool calls → run tools → repeat.

``run_turns`` reads as the turn's outline; each part is a small function over ``_RunState``.
Each model call's prompt is rendered once (again only after a compaction changed the window)
and that ``RenderedPrompt`` is carried to window fitting, cache-break attribution, generation and
the self-check.
Runs go through the runtime, which adds the conversation's lease, window refresh and snapshot::

    result = await runtime.run(conversation, "What is 17 * 23?")
    async for event in runtime.run_stream(conversation, "And now divide by 7"):
        ...

The user message is recorded (committed) before the first model call; each assistant message
and tool result as it happens. Cancellation leaves the KV session consistent (the engine
guarantees it per operation) and the recorded messages intact. A user message that cannot fit the
window is refused before it is recorded, or (when only the policy could tell) taken out of the
window again, so it never blocks later turns. A tool call cut by the token limit (a parallel one
after complete calls too) is retried once with room for it; tool-call markup, a cut opening tag
included, never reaches ``RunResult.final_text``, the recorded messages or the streamed text.
Identical calls (same name and arguments) in one model call run once: the parser drops the
repeats; the assistant message keeps the generated tokens verbatim (the KV is what the model
wrote) and lists each distinct call once, each with one result.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio

from agentkv.agent import Agent
from agentkv.chat.messages import Message, ToolCall, pending_tool_calls
from agentkv.chat.reasoning import ReasoningSplitter
from agentkv.chat.render import RenderedPrompt
from agentkv.chat.stream_filter import MarkupFilter, VisibleTokens
from agentkv.chat.structured_output import OutputInvalid
from agentkv.engine.generation import GenerationMetrics, GenerationResult, TokenLogprob
from agentkv.errors import ContextOverflowError, MaxModelCallsExceeded
from agentkv.events import (
    ApprovalRequired,
    CacheBroken,
    ContextCompacted,
    ModelCallFinished,
    ReasoningDelta,
    RunEvent,
    RunFinished,
    SelfCheckFailed,
    TextDelta,
    ToolCalled,
    ToolReturned,
)
from agentkv.observe import tracing
from agentkv.observe.cache_breaks import CacheBreak
from agentkv.observe.self_check import SelfCheckResult
from agentkv.result import FinishReason, RunResult
from agentkv.run.approvals import (
    Decisions,
    awaiting_approval,
    checked_decisions,
    needs_approval,
    rejected_result,
)
from agentkv.run.call_checks import describe_call
from agentkv.run.call_settings import (call_config, call_constraint, reasoning_ids_of, reasoning_tags_of, room,
                                       tool_format_of)
from agentkv.run.conversation import Conversation, WindowEntry
from agentkv.run.input import RunInput, checked_input
from agentkv.run.past_reasoning import drop_left_out_reasoning
from agentkv.run.reply import Reply, read_reply
from agentkv.tools import run_tool_calls

logger = logging.getLogger(__name__)
CANCELLED_RESULT = "error: the run was cancelled before this tool returned"


@dataclass
class _RunState:
    """Everything one run accumulates."""

    agent: Agent
    conversation: Conversation
    new_messages: list[Message] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    metrics: list[GenerationMetrics] = field(default_factory=list)
    breaks: list[CacheBreak | None] = field(default_factory=list)
    checks: list[SelfCheckResult] = field(default_factory=list)
    last_result: GenerationResult | None = None
    """The newest model call's result (set when its stream ends)."""
    prompt: RenderedPrompt | None = None
    """The next model call's prompt over the current window (None: the window changed since)."""

    def result(self, final_text: str, finish_reason: FinishReason = "stop",
               pending: tuple[ToolCall, ...] = (), output: Any = None, *,
               approvals: tuple[ToolCall, ...] = (), reasoning: str | None = None) -> RunResult:
        return RunResult(
            conversation_id=self.conversation.id,
            final_text=final_text,
            new_messages=tuple(self.new_messages),
            tool_calls=tuple(self.tool_calls),
            call_metrics=tuple(self.metrics),
            cache_breaks=tuple(self.breaks),
            self_checks=tuple(self.checks),
            finish_reason=finish_reason,
            pending_tool_calls=pending,
            pending_approvals=approvals,
            output=output,
            reasoning=reasoning,
        )


async def run_turns(agent: Agent, conversation: Conversation,
                    user_input: RunInput | Decisions) -> AsyncGenerator[RunEvent, None]:
    """The turn loop of one run, without the one-run-per-conversation guard (the caller holds
    it): ``async for event in run_turns(agent, conversation, "hi"): ...``."""
    state = _RunState(agent, conversation)
    checks = conversation.call_checks
    recorded: list[WindowEntry] = []
    if isinstance(user_input, Decisions):
        async with aclosing(_apply_decisions(state, user_input)) as applied:
            async for event in applied:
                yield event
                if isinstance(event, RunFinished):
                    return
    else:
        recorded = await _record_input(state, user_input)
    for call_index in range(agent.max_model_calls):
        async with aclosing(_fit_window(state)) as compactions:
            try:
                async for event in compactions:
                    checks.expect("window compaction")
                    if isinstance(event, ContextCompacted):
                        checks.note(f"compaction by {event.policy}: {event.tokens_before} → "
                                    f"{event.tokens_after} tokens")
                        tracing.finished("agentkv.compaction", conversation.trace_span, event.cost_ms / 1000,
                                         policy=event.policy, tokens_before=event.tokens_before,
                                         tokens_after=event.tokens_after, fallback=event.fallback)
                    yield event
            except ContextOverflowError:
                if call_index == 0:  # NOTE: out of the window (still stored): it must not block later turns
                    with anyio.CancelScope(shield=True):
                        await conversation.replace_in_window(recorded)
                raise
        assert state.prompt is not None
        async with aclosing(_generate_with_retry(state, call_index, state.prompt)) as generation:
            async for delta in generation:
                yield delta
        result = state.last_result
        assert result is not None
        reply = read_reply(state.agent, result, renderer=state.conversation.renderer)
        await _record_assistant(state, result, reply)
        external = agent.external_tool_names
        ours = tuple(c for c in reply.calls if c.name not in external and not needs_approval(agent, c))
        try:
            yield ModelCallFinished(call_index, result.metrics)
            if reply.finish != "tool_calls":
                yield RunFinished(_final_result(state, reply))
                return
        except BaseException:
            # NOTE: stopped (cancelled, or the consumer closed the stream) after recording our calls
            # and before all their results: each gets one — an orphaned call would be rendered into
            # every later prompt (orphaned results broke LangChain's trimming, #33245)
            with anyio.CancelScope(shield=True):
                await _answer_cancelled(state, ours)
            raise
        if ours:
            async with aclosing(_run_tools(state, ours)) as tools:
                async for event in tools:
                    yield event
        for call in reply.calls:
            if call.name in external:
                yield ToolCalled(call)
        async with aclosing(_stop_if_waiting(state, reply.content, reply.reasoning)) as stop:
            async for event in stop:
                yield event
                if isinstance(event, RunFinished):
                    return
    raise MaxModelCallsExceeded(agent.max_model_calls, state.result("", "max_model_calls"))


async def _answer_cancelled(state: _RunState, calls: tuple[ToolCall, ...]) -> None:
    """Record ``CANCELLED_RESULT`` for each of ``calls`` still without a result."""
    pending = pending_tool_calls(state.conversation.messages)
    for call in calls:
        if call.id in pending:
            await _record(state, Message.tool(CANCELLED_RESULT, tool_call_id=call.id, name=call.name))


async def _stop_if_waiting(state: _RunState, content: str, reasoning: str | None) -> AsyncGenerator[RunEvent, None]:
    """End the run when calls wait: for a person's approval (``approval_required``), or for the
    caller's results (``tool_calls``); otherwise yield nothing and the run goes on."""
    agent, messages = state.agent, state.conversation.messages
    approvals = awaiting_approval(agent, messages)
    theirs = tuple(c for c in pending_tool_calls(messages).values() if c.name in agent.external_tool_names)
    if approvals:
        yield ApprovalRequired(approvals)
        yield RunFinished(state.result(content, "approval_required", theirs, approvals=approvals,
                                       reasoning=reasoning))
    elif theirs:  # the caller runs these and continues the run with their results
        yield RunFinished(state.result(content, "tool_calls", theirs, reasoning=reasoning))


async def _apply_decisions(state: _RunState, decisions: Decisions) -> AsyncGenerator[RunEvent, None]:
    """Record each rejection, run the approved calls; end the run if calls still wait."""
    approved, rejected = checked_decisions(state.agent, state.conversation.messages, decisions)
    for call, reason in rejected:
        content = rejected_result(reason)
        await _record(state, Message.tool(content, tool_call_id=call.id, name=call.name))
        yield ToolReturned(call, content, True, 0.0)
    if approved:
        async with aclosing(_run_tools(state, approved)) as tools:
            async for event in tools:
                yield event
    async with aclosing(_stop_if_waiting(state, "", None)) as stop:
        async for event in stop:
            yield event


async def _record(state: _RunState, message: Message) -> WindowEntry:
    state.prompt = None  # the window changes
    entry = await state.conversation.record(message)
    state.new_messages.append(message)
    return entry


async def _record_input(state: _RunState, run_input: RunInput) -> list[WindowEntry]:
    """Record what the run starts from — checked first, so a refused input records nothing."""
    return await _record_new(state, checked_input(state.agent, state.conversation.messages, run_input))


async def _record_new(state: _RunState, messages: list[Message]) -> list[WindowEntry]:
    """Record ``messages`` unless they cannot fit the window whatever the policy does. Without a
    policy the prompt checked is the first model call's: it is carried to it (``state.prompt``)."""
    agent, conversation = state.agent, state.conversation
    limit = _prompt_limit(state)
    history = conversation.messages if agent.policy is None else []  # a policy can free the history
    rendered = conversation.render_with(agent, [*history, *messages])
    needed = len(rendered.token_ids)
    if needed > limit and not (agent.truncate_oversized_messages and agent.policy is not None):
        where = "with the system prompt" if agent.policy is not None else "with the history (the agent has no policy)"
        raise ContextOverflowError(
            f"this message needs a prompt of {needed} tokens {where}, over the budget of {limit} "
            f"(max_prompt_len - min_response_len); nothing was recorded: send a shorter message, raise "
            f"max_prompt_len, or give the agent a policy and truncate_oversized_messages=True",
            prompt_tokens=needed,
            limit=limit,
        )
    recorded = [await _record(state, message) for message in messages]
    if agent.policy is None:  # NOTE: the window is now ``history + messages``: this is its prompt
        state.prompt = rendered
    return recorded


async def _fit_window(state: _RunState) -> AsyncGenerator[RunEvent, None]:
    """Apply the agent's context policy when the prompt exceeds its budget; sets
    ``state.prompt`` to the next model call's prompt (rendered once, again only after a
    compaction changed the window)."""
    agent, conversation = state.agent, state.conversation
    limit = _prompt_limit(state)
    prompt = state.prompt = state.prompt or conversation.render(agent)
    if len(prompt.token_ids) <= limit:
        return
    if agent.policy is None:
        raise ContextOverflowError(
            f"the prompt has {len(prompt.token_ids)} tokens, over the budget of {limit} "
            f"(max_prompt_len - min_response_len); give the agent a policy, e.g. "
            f"Agent(policy=Truncation()), or raise max_prompt_len",
            prompt_tokens=len(prompt.token_ids),
            limit=limit,
        )
    state.prompt = None
    async with aclosing(agent.policy.compact(conversation, agent, limit=limit)) as events:
        async for event in events:
            yield event
    compacted = state.prompt = conversation.render(agent)  # NOTE: the window changed: render the new one
    if len(compacted.token_ids) > limit:
        raise ContextOverflowError(
            f"the context policy {agent.policy!r} left {len(compacted.token_ids)} tokens, over the budget of "
            f"{limit}; use one of agentkv.policies or raise max_prompt_len",
            prompt_tokens=len(compacted.token_ids),
            limit=limit,
        )


def _prompt_limit(state: _RunState) -> int:
    return state.agent.prompt_budget(state.conversation.context_len)


async def _generate_with_retry(state: _RunState, call_index: int,
                               prompt: RenderedPrompt) -> AsyncGenerator[RunEvent, None]:
    """One model call on ``prompt``; a tool call cut by the token limit is generated once more
    with all the room the window leaves (its text was streamed already, so the retry streams
    nothing). Sets
    ``state.last_result``."""
    async with aclosing(_generate(state, call_index, prompt)) as generation:
        async for delta in generation:
            yield delta
    result = state.last_result
    assert result is not None
    # NOTE: all the room the window leaves: the grammar bounds every call (strings, arrays, how
    # many calls), so the retry ends with the calls, and a fixed budget could cut them again
    budget = room(state.agent, state.conversation.context_len, len(prompt.token_ids))
    reply = read_reply(state.agent, result, renderer=state.conversation.renderer)
    if reply.finish == "tool_call_cut" and budget > result.metrics.generated_tokens:
        state.conversation.call_checks.expect("retry of a cut tool call")
        async with aclosing(_generate(state, call_index, prompt, max_new_tokens=budget)) as generation:
            async for _ in generation:
                pass


async def _generate(state: _RunState, call_index: int, prompt: RenderedPrompt, *,
                    max_new_tokens: int | None = None) -> AsyncGenerator[RunEvent, None]:
    """One model call on the conversation's KV; streams visible text (and, apart, a reasoning
    model's thinking), then sets ``state.last_result``."""
    agent, conversation = state.agent, state.conversation
    checks = conversation.call_checks
    config = call_config(agent, conversation.context_len, len(prompt.token_ids))
    if max_new_tokens is not None:
        config = config.model_copy(update={"max_new_tokens": max_new_tokens})
    tool_format = tool_format_of(conversation.renderer)
    tags = reasoning_tags_of(conversation.renderer)
    visible = VisibleTokens(MarkupFilter(tool_format.open_tag) if agent.tools and agent.tool_choice != "none" else None,
                            ReasoningSplitter(tags) if tags is not None else None)
    await drop_left_out_reasoning(conversation, agent, prompt)  # NOTE: before the break check: no KV is lost
    found = checks.break_before(agent, conversation.kv.tokens, prompt, conversation.renderer.tokenizer)
    state.breaks.append(found)
    if found is not None:
        yield CacheBroken(call_index, found)
    constraint = call_constraint(agent, conversation.engine, call_index, tool_format=tool_format, reasoning_tags=tags,
                                 reasoning_ids=reasoning_ids_of(conversation.renderer))
    with tracing.span("agentkv.model_call", conversation.trace_span, conversation_id=conversation.id,
                      call_index=call_index) as call_span:
        async with conversation.kv.stream(prompt.token_ids, config, constraint) as stream:
            async for delta in stream:
                for event in _shown(*visible.step(delta)):
                    yield event
        assert stream.result is not None
        describe_call(call_span, stream.result.metrics, found)
    for event in _shown(*visible.end()):
        yield event
    checked = await checks.after_call(conversation.engine, conversation.kv, prompt, call_index, stream.result.metrics,
                                      found, label=conversation.id)
    if checked is not None:
        state.checks.append(checked)
        if not checked.passed:
            yield SelfCheckFailed(conversation.id, checked, checks.take_operations())
    state.metrics.append(stream.result.metrics)
    state.last_result = stream.result


def _shown(thought: str, text: str, logprobs: tuple[TokenLogprob, ...]) -> list[RunEvent]:
    """The events of what one step of the stream shows: thinking, then answer text."""
    return [*([ReasoningDelta(thought)] if thought else []), *([TextDelta(text, logprobs)] if text else [])]


def _final_result(state: _RunState, reply: Reply) -> RunResult:
    """The run's result from its last reply; with an ``output_type`` the answer parsed."""
    output, reasoning = state.agent.output_spec, reply.reasoning
    if output is None or reply.finish != "stop":
        return state.result(reply.content, reply.finish, reasoning=reasoning)
    try:
        return state.result(reply.content, "stop", output=output.parse(reply.content), reasoning=reasoning)
    except OutputInvalid as error:
        logger.warning("run of agent %r: %s", state.agent.name, error)
        return state.result(reply.content, "output_invalid", reasoning=reasoning)


async def _record_assistant(state: _RunState, result: GenerationResult, reply: Reply) -> Message:
    """Record the assistant message: generated ids kept verbatim, except for a broken call,
    whose markup is dropped (only the text around it stays in the history)."""
    broken = reply.finish in ("tool_call_cut", "tool_call_invalid")
    token_ids = None if broken else result.token_ids
    if broken:  # NOTE: the discarded markup leaves the KV too, so the KV stays a prefix of the history
        await state.conversation.kv.trim(result.metrics.prompt_tokens)
    message = Message.assistant(reply.content, tool_calls=reply.calls, token_ids=token_ids, reasoning=reply.reasoning)
    await _record(state, message)
    state.tool_calls.extend(reply.calls)
    return message


async def _run_tools(state: _RunState, calls: tuple[ToolCall, ...]) -> AsyncGenerator[RunEvent, None]:
    """Run the calls concurrently; record and announce each result in call order. Stopped
    before that, each call still without a result gets ``CANCELLED_RESULT``."""
    try:
        for call in calls:
            yield ToolCalled(call)
        outcomes = await run_tool_calls(state.agent.tools, calls, default_timeout_s=state.agent.tool_timeout_s)
        for outcome in outcomes:
            await _record(state, outcome.to_message())
            tracing.finished("agentkv.tool_call", state.conversation.trace_span, outcome.duration_s,
                             tool=outcome.call.name, call_id=outcome.call.id, is_error=outcome.is_error)
            yield ToolReturned(outcome.call, outcome.content, outcome.is_error, outcome.duration_s)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await _answer_cancelled(state, calls)
        raise
