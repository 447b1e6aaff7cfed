"""The agent loop: render → fit the window → generate → parse tool calls → run tools → repeat.

``Runner.run`` reads as the turn's outline; each step is a small function over ``_RunState``::

    result = await Runner.run(agent, session, "What is 17 * 23?")
    async for event in Runner.run_stream(agent, session, "And now divide by 7"):
        ...

The user message is recorded (committed) before the first model call; each assistant message
and tool result as it happens. Cancellation leaves the KV session consistent (the engine
guarantees it per step) and the recorded messages intact.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

import anyio

from agentkv.agent import Agent
from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.stream_filter import MarkupFilter
from agentkv.chat.toolcalls import TOOL_CALL_OPEN, parse_tool_calls, tool_call_grammar
from agentkv.conversation import AgentSession
from agentkv.engine.base import (
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
)
from agentkv.errors import ContextOverflowError, MaxTurnsExceeded
from agentkv.events import (
    RunEvent,
    RunFinished,
    TextDelta,
    ToolCallEvent,
    ToolResultEvent,
    TurnMetricsEvent,
)
from agentkv.result import RunResult
from agentkv.tools import run_tool_calls

CANCELLED_RESULT = "error: the run was cancelled before this tool returned"


@dataclass
class _RunState:
    """Everything one run accumulates."""

    agent: Agent
    session: AgentSession
    new_messages: list[Message] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    metrics: list[GenerationMetrics] = field(default_factory=list)

    def result(self, final_text: str) -> RunResult:
        return RunResult(
            session_id=self.session.id,
            final_text=final_text,
            new_messages=tuple(self.new_messages),
            tool_calls=tuple(self.tool_calls),
            step_metrics=tuple(self.metrics),
        )


class Runner:
    """Runs agents. Stateless: all state lives in the session and the run's ``_RunState``."""

    @staticmethod
    async def run(agent: Agent, session: AgentSession, user_input: str) -> RunResult:
        """Run until the model answers without calling a tool; return the result."""
        result: RunResult | None = None
        async for event in Runner.run_stream(agent, session, user_input):
            if isinstance(event, RunFinished):
                result = event.result
        assert result is not None
        return result

    @staticmethod
    async def run_stream(agent: Agent, session: AgentSession, user_input: str) -> AsyncIterator[RunEvent]:
        """Like ``run`` but yields typed events as they happen; the last is ``RunFinished``.

        To stop early, close the stream (``async with contextlib.aclosing(...)``): that ends the
        generation at the current step and releases the session.
        """
        async with session.run_guard():
            async with aclosing(run_turns(agent, session, user_input)) as events:
                async for event in events:
                    yield event


async def run_turns(agent: Agent, session: AgentSession, user_input: str) -> AsyncIterator[RunEvent]:
    """The turn loop of one run, without the one-run-per-session guard (the caller holds it)."""
    state = _RunState(agent, session)
    await _record(state, Message.user(user_input))
    for step in range(agent.max_turns):
        async with aclosing(_fit_window(state)) as compactions:
            async for event in compactions:
                yield event
        result: GenerationResult | None = None
        async with aclosing(_generate(state, step)) as generation:
            async for item in generation:
                if isinstance(item, GenerationResult):
                    result = item
                else:
                    yield item
        assert result is not None
        assistant = await _record_assistant(state, result)
        yield TurnMetricsEvent(step, result.metrics)
        if not assistant.tool_calls:
            yield RunFinished(state.result(assistant.content))
            return
        async with aclosing(_run_tools(state, assistant.tool_calls)) as tools:
            async for event in tools:
                yield event
    raise MaxTurnsExceeded(agent.max_turns)


async def _record(state: _RunState, message: Message) -> None:
    await state.session.record(message)
    state.new_messages.append(message)


async def _fit_window(state: _RunState) -> AsyncIterator[RunEvent]:
    """Apply the agent's context policy when the prompt exceeds its budget."""
    agent, session = state.agent, state.session
    limit = _prompt_limit(state)
    prompt_len = len(session.render(agent).token_ids)
    if prompt_len <= limit:
        return
    if agent.policy is None:
        raise ContextOverflowError(
            f"the prompt has {prompt_len} tokens, over the budget of {limit} "
            f"(max_prompt_len - min_response_len); give the agent a policy, e.g. "
            f"Agent(policy=Truncation()), or raise max_prompt_len",
            prompt_tokens=prompt_len,
            limit=limit,
        )
    async with aclosing(agent.policy.compact(session, agent, limit=limit)) as events:
        async for event in events:
            yield event
    compacted_len = len(session.render(agent).token_ids)
    if compacted_len > limit:
        raise ContextOverflowError(
            f"the context policy {agent.policy!r} left {compacted_len} tokens, over the budget of "
            f"{limit}; use one of agentkv.policies or raise max_prompt_len",
            prompt_tokens=compacted_len,
            limit=limit,
        )


def _prompt_limit(state: _RunState) -> int:
    agent = state.agent
    context = state.session.context_len
    max_prompt = min(agent.max_prompt_len or context, context)
    return max_prompt - agent.min_response_len


async def _generate(state: _RunState, step: int) -> AsyncIterator[TextDelta | GenerationResult]:
    """One model call on the session's KV; streams visible text, then yields the result."""
    agent, session = state.agent, state.session
    prompt = session.render(agent)
    config = _step_config(state, len(prompt.token_ids))
    hide = MarkupFilter(TOOL_CALL_OPEN) if agent.tools and agent.tool_choice != "none" else None
    async with session.kv.stream(prompt.token_ids, config, _constraint(state, step)) as stream:
        async for delta in stream:
            text = hide.feed(delta.text) if hide else delta.text
            if text:
                yield TextDelta(text)
    if hide is not None and (tail := hide.flush()):
        yield TextDelta(tail)
    assert stream.result is not None
    state.metrics.append(stream.result.metrics)
    yield stream.result


def _step_config(state: _RunState, prompt_len: int) -> GenerationConfig:
    """The agent's config, with max_new_tokens capped to what the window leaves."""
    agent = state.agent
    max_prompt = min(agent.max_prompt_len or state.session.context_len, state.session.context_len)
    room = max(1, max_prompt - prompt_len)
    if agent.generation.max_new_tokens <= room:
        return agent.generation
    return agent.generation.model_copy(update={"max_new_tokens": room})


def _constraint(state: _RunState, step: int) -> TokenConstraint | None:
    """A grammar for tool calls, when the agent has tools and the engine supports grammars."""
    agent = state.agent
    if not agent.tools or agent.tool_choice == "none" or not agent.constrain_tool_calls:
        return None
    # The forced choice applies to the first model call only; after tool results the model
    # must be free to answer (otherwise "required" could never finish).
    choice = agent.tool_choice if step == 0 else "auto"
    make = getattr(state.session.engine, "make_constraint", None)
    if make is None:
        return None
    return make(tool_call_grammar(agent.tool_schemas, choice))


async def _record_assistant(state: _RunState, result: GenerationResult) -> Message:
    """Turn the generated ids into the assistant message (ids kept verbatim) and record it."""
    agent = state.agent
    if agent.tools and agent.tool_choice != "none":
        parsed = parse_tool_calls(result.text)
        content, calls = parsed.content, parsed.tool_calls
        if parsed.errors and not calls:
            content = result.text
    else:
        content, calls = result.text, ()
    message = Message.assistant(content, tool_calls=calls, token_ids=result.token_ids)
    await _record(state, message)
    state.tool_calls.extend(calls)
    return message


async def _run_tools(state: _RunState, calls: tuple[ToolCall, ...]) -> AsyncIterator[RunEvent]:
    """Run the calls concurrently; record and announce each result in call order."""
    for call in calls:
        yield ToolCallEvent(call)
    try:
        outcomes = await run_tool_calls(state.agent.tools, calls, default_timeout_s=state.agent.tool_timeout_s)
    except anyio.get_cancelled_exc_class():
        # NOTE: every recorded call gets a result, even on cancel: an orphaned call would be
        # rendered into every later prompt (orphaned results broke LangChain's trimming, #33245).
        with anyio.CancelScope(shield=True):
            for call in calls:
                await _record(state, Message.tool(CANCELLED_RESULT, tool_call_id=call.id, name=call.name))
        raise
    for outcome in outcomes:
        await _record(state, outcome.to_message())
        yield ToolResultEvent(outcome.call, outcome.content, outcome.is_error, outcome.duration_s)
