"""Truncation: drop the oldest whole messages; the KV is trimmed to the common prefix and re-prefilled.

The simplest policy and the fallback of the others. The system prompt stays (its KV is the
common prefix, so only the kept messages are re-prefilled)::

    agent = Agent(name="chat", policy=Truncation(low_water=0.6), max_prompt_len=1024)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv.policies.base import WindowPolicy, truncate
from agentkv.policies.selection import plan_removal

if TYPE_CHECKING:
    from agentkv.policies.protocol import AgentT, ConversationView


class Truncation(WindowPolicy):
    """Drop the oldest messages (tool calls with their results) down to the low-water mark."""

    name = "truncation"

    async def _remove(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, target: int
    ) -> tuple[int, str | None]:
        plan = plan_removal(conversation.window, conversation.render(agent), target=target)
        await truncate(conversation, agent, plan)
        return len(plan.entries), None
