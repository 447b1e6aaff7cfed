"""Budget helpers and the compaction outline every built-in policy shares.

The agent loop (``agentkv.run.loop``) calls ``policy.compact(conversation, agent, limit=limit)``
(``ContextPolicy``, in ``agentkv.policies.protocol``) when the rendered prompt exceeds ``limit``
(``max_prompt_len - min_response_len``); the policy brings the prompt down to its low-water mark
(a fraction of ``limit``, so compaction is rare) and yields one ``ContextCompacted`` event::

    agent = Agent(name="chat", policy=Truncation(low_water=0.7), max_prompt_len=2048)
    async for event in agent.policy.compact(conversation, agent, limit=1792):
        print(event.policy, event.tokens_before, "→", event.tokens_after)

Policies see the conversation only as a ``ConversationView`` (see ``agentkv.policies.protocol``).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING

from agentkv.errors import ContextOverflowError, UserError
from agentkv.events import ContextCompacted
from agentkv.policies.oversize import fit_oversized
from agentkv.policies.selection import RemovalPlan, plan_removal

if TYPE_CHECKING:
    from agentkv.policies.protocol import AgentT, ConversationView

DEFAULT_LOW_WATER = 0.7


def low_water_tokens(limit: int, ratio: float) -> int:
    """The prompt size compaction aims for: ``low_water_tokens(1000, 0.7) == 700``."""
    return max(0, int(limit * ratio))


def check_low_water(ratio: float) -> float:
    """``ratio`` if it is a number in (0, 1]; ``UserError`` otherwise (NaN, a string, a bool)."""
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0.0 < ratio <= 1.0:
        raise UserError(f"low_water must be a fraction of the budget in (0, 1], got {ratio}")
    return ratio


def prompt_tokens(conversation: ConversationView[AgentT], agent: AgentT) -> int:
    """Tokens of the prompt the runner would send now (generation prompt included)."""
    return len(conversation.render(agent).token_ids)


async def truncate(conversation: ConversationView[AgentT], agent: AgentT, plan: RemovalPlan) -> None:
    """Drop the plan's messages from the window and re-prefill from the divergence (inside the
    compaction, so the next model call prefills nothing and the event's cost includes it)."""
    if plan.entries:
        await conversation.replace_in_window(plan.entries)
    await conversation.realign(agent)


class WindowPolicy(ABC):
    """The outline shared by the built-in policies: fit oversized messages, remove (subclass),
    check the budget, report. Subclasses implement ``_remove`` and set ``name``."""

    name = "window"

    def __init__(self, *, low_water: float = DEFAULT_LOW_WATER) -> None:
        self.low_water = check_low_water(low_water)
        """Fraction of the budget compaction brings the prompt down to."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(low_water={self.low_water})"

    async def compact(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, limit: int
    ) -> AsyncGenerator[ContextCompacted, None]:
        """See ``ContextPolicy.compact``."""
        started = time.perf_counter()
        before = prompt_tokens(conversation, agent)
        target = low_water_tokens(limit, self.low_water)
        await fit_oversized(conversation, agent, limit=limit, target=target)
        removed, fallback_reason = await self._remove(conversation, agent, target=target)
        after = prompt_tokens(conversation, agent)
        if after > limit:  # a template that renders history-dependently can defeat the estimate
            plan = plan_removal(conversation.window, conversation.render(agent), target=limit)
            await truncate(conversation, agent, plan)
            removed += len(plan.entries)
            after = prompt_tokens(conversation, agent)
        if after > limit:
            raise ContextOverflowError(
                f"after compaction the prompt still has {after} tokens, over the budget of {limit}; "
                "shorten the system prompt or raise max_prompt_len",
                prompt_tokens=after,
                limit=limit,
            )
        cost_ms = (time.perf_counter() - started) * 1000
        fallback = None if fallback_reason is None else "truncation"
        yield ContextCompacted(self.name, before, after, removed, cost_ms, fallback, fallback_reason)

    @abstractmethod
    async def _remove(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, target: int
    ) -> tuple[int, str | None]:
        """Remove messages towards ``target`` tokens; return (messages removed, None — or the
        reason the policy fell back to truncation, which the event reports)."""
