"""Tool calls that wait for a person: which calls need approval, which are waiting, and the
decisions that continue a run.

A tool made with ``@tool(requires_approval=True)`` (or any call an agent's ``needs_approval``
predicate picks) is not run when the model calls it: the run records the call and stops with
``finish_reason="approval_required"``. The call waits in the stored history — across restarts —
until a run continues with ``Decisions``::

    result = await runtime.run(conversation, "Delete the old logs")
    result.pending_approvals                     # (ToolCall(name="delete_files", ...),)
    result = await runtime.approve(conversation, result.pending_approvals[0].id)
    # or: await runtime.reject(conversation, call_id, "not today")

Approved calls run then; rejected ones get a result saying so (``rejected_result``); once no call
waits, the model continues on the same KV, prefilling only the results.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from agentkv.chat.messages import Message, ToolCall, pending_tool_calls
from agentkv.errors import UserError

if TYPE_CHECKING:
    from agentkv.agent import Agent


@dataclass(frozen=True)
class Decisions:
    """What a person decided about calls waiting for approval: ``approve`` (call ids to run) and
    ``reject`` (call id → the reason the model is told): ``Decisions(approve=["call_1"])``."""

    approve: Sequence[str] = ()
    """Ids of the waiting calls to run (``ToolCall.id``; kept as a tuple)."""
    reject: Mapping[str, str] = field(default_factory=dict)
    """Call id → the reason the model is told, in the call's result ``"error: the user rejected
    this call: <reason>"`` (a blank reason leaves the ``": <reason>"`` out); kept as a dict."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "approve", tuple(self.approve))
        object.__setattr__(self, "reject", dict(self.reject))
        both = sorted(set(self.approve) & set(self.reject))
        if both:
            raise UserError(f"calls {both} are both approved and rejected; decide each call once")
        if not self.approve and not self.reject:
            raise UserError("no decision: pass call ids to approve or a {call id: reason} to reject")


def needs_approval(agent: Agent, call: ToolCall) -> bool:
    """True when ``call`` must be approved before it runs: its tool says so, or the agent's
    ``needs_approval`` predicate does. Calls the caller executes never need it."""
    tool = next((t for t in agent.tools if t.name == call.name), None)
    if tool is None or tool.is_external:
        return False
    return tool.requires_approval or (agent.needs_approval is not None and bool(agent.needs_approval(call)))


def awaiting_approval(agent: Agent, messages: Sequence[Message]) -> tuple[ToolCall, ...]:
    """The calls in ``messages`` without a result that wait for approval, in call order."""
    return tuple(call for call in pending_tool_calls(messages).values() if needs_approval(agent, call))


def checked_decisions(agent: Agent, messages: Sequence[Message], decisions: Decisions) -> tuple[
        tuple[ToolCall, ...], tuple[tuple[ToolCall, str], ...]]:
    """The approved calls and the rejected ones with their reason; ``UserError`` for a decision
    about a call that is not waiting for approval."""
    waiting = {call.id: call for call in awaiting_approval(agent, messages)}
    unknown = sorted((set(decisions.approve) | set(decisions.reject)) - set(waiting))
    if unknown:
        raise UserError(f"calls {unknown} are not waiting for approval (waiting: {sorted(waiting) or 'none'})")
    approved = tuple(waiting[cid] for cid in decisions.approve)
    rejected = tuple((waiting[cid], reason) for cid, reason in decisions.reject.items())
    return approved, rejected


def rejected_result(reason: str) -> str:
    """The tool result the model reads for a rejected call."""
    return f"error: the user rejected this call: {reason}" if reason.strip() else "error: the user rejected this call"


def describe_waiting(calls: Iterable[ToolCall]) -> str:
    """``name(id)`` of each call, for error messages."""
    return ", ".join(f"{call.name} ({call.id})" for call in calls)
