"""What a run starts from, checked against the conversation it continues: a user message's text,
or messages (OpenAI chat dicts or ``Message``s) such as the results of calls a run left pending.

::

    messages = checked_input(agent, conversation.messages, [{"role": "tool", "tool_call_id": "c1", "content": "4"}])

Nothing here records anything: the runner records what this returns, so refused input leaves
the conversation as it was.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentkv.agent import Agent
from agentkv.chat.messages import Message, pending_tool_calls
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.errors import UserError
from agentkv.run.approvals import describe_waiting, needs_approval

RunInput = str | Sequence[Mapping[str, object] | Message]
"""What a run starts from: a user message's text, or messages (OpenAI chat dicts or
``Message``s) — e.g. the results of the calls a previous run left pending."""


def checked_input(agent: Agent, window: Sequence[Message], run_input: RunInput) -> list[Message]:
    """``run_input`` as messages that may follow ``window``: tool results answer pending calls
    (named after them), no user or assistant turn jumps a pending call, a system message is the
    agent's own instructions (left out), and the last message is one the model can answer.
    ``UserError`` names the message that breaks a rule."""
    messages = [Message.user(run_input)] if isinstance(run_input, str) else messages_from_openai(_sequence(run_input))
    pending = pending_tool_calls(window)
    kept: list[Message] = []
    for index, message in enumerate(messages):
        if message.role == "system":
            if message.content != agent.instructions:
                raise UserError(f"message {index}: a system message must be the agent's instructions; set "
                                f"Agent(instructions=...) to change them (agent {agent.name!r})")
            continue
        if message.role == "tool":
            call = pending.pop(message.tool_call_id or "", None)
            if call is None:
                raise UserError(f"message {index}: tool_call_id {message.tool_call_id!r} answers no pending "
                                f"tool call (pending: {sorted(pending) or 'none'})")
            kept.append(message.model_copy(update={"name": call.name}))
            continue
        waiting = [call for call in pending.values() if needs_approval(agent, call)]
        if waiting:
            raise UserError(
                f"message {index} ({message.role}) cannot come before a decision on the calls waiting for "
                f"approval: {describe_waiting(waiting)}; approve or reject each first: "
                "runtime.approve(conversation, call_id) / runtime.reject(conversation, call_id, reason)")
        if pending:
            raise UserError(
                f"message {index} ({message.role}) cannot come before the results of the pending tool calls "
                f"{sorted(pending)}; continue the run with a tool message for each: "
                "[{'role': 'tool', 'tool_call_id': ..., 'content': ...}]")
        pending.update({c.id: c for c in message.tool_calls})
        kept.append(message)
    if not kept:
        raise UserError("the run needs a user message or tool results to answer; got none")
    if pending:
        raise UserError(f"the tool calls {sorted(pending)} still need results: send a tool message for each")
    if kept[-1].role == "assistant":
        raise UserError("the last message is the assistant's: end with a user message or tool results to answer")
    return kept


def _sequence(run_input: object) -> Sequence[Mapping[str, object] | Message]:
    """``run_input`` if it is a sequence of messages (a list, a tuple); ``UserError`` saying what to
    pass otherwise (bytes too: decode them first)."""
    if isinstance(run_input, Sequence) and not isinstance(run_input, (bytes, bytearray)):
        return run_input
    raise UserError(
        f"a run takes a user message's text (str) or a list of messages (OpenAI chat dicts or Messages), "
        f"got {type(run_input).__name__}: e.g. runtime.run(conversation, \"Hello\") or "
        "runtime.run(conversation, [{'role': 'tool', 'tool_call_id': ..., 'content': ...}])"
    )
