"""SlidingWindow: drop the oldest messages' token spans from the KV directly (span drop + RoPE shift).

The same messages leave as with ``Truncation``, but instead of re-prefilling what follows
them, the conversation removes their spans from every layer's K and V and re-rotates the later
keys (``ConversationView.drop_spans``): the compaction costs a state read/write, not a prefill. The
system prompt stays in front as the attention sink. The kept tokens' K/V were computed while the
dropped ones were visible, so the KV is marked shifted (close to, not equal to, a fresh
prefill). Falls back to ``Truncation`` when the conversation cannot drop spans: a warning is
logged and the ``ContextCompacted`` event says ``fallback="truncation"`` with the reason::

    agent = Agent(name="chat", policy=SlidingWindow(), max_prompt_len=1024)
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from agentkv.engine.base import common_prefix_len
from agentkv.errors import KVShiftUnsupported
from agentkv.policies.base import WindowPolicy, truncate
from agentkv.policies.selection import plan_removal

if TYPE_CHECKING:
    from agentkv.policies.protocol import AgentT, ConversationView

logger = logging.getLogger(__name__)


class SlidingWindow(WindowPolicy):
    """Drop the oldest messages from the KV by span drop + RoPE shift; no re-prefill."""

    name = "sliding_window"

    async def _remove(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, target: int
    ) -> tuple[int, str | None]:
        rendered = conversation.render(agent)
        plan = plan_removal(conversation.window, rendered, target=target)
        if not plan.entries:
            return 0, None
        if not conversation.supports_drop:
            reason = "the conversation's engine cannot drop KV spans"
            logger.warning("conversation %s: %s; falling back to truncation", conversation.id, reason)
            await truncate(conversation, agent, plan)
            return len(plan.entries), reason
        # Only what the KV holds can be dropped from it (a span may be held in part: the last
        # answer's final token is never fed); anything later is prefilled anyway.
        covered = common_prefix_len(conversation.kv_tokens, rendered.token_ids)
        ranges = [(start, min(end, covered)) for start, end in plan.token_ranges if start < covered]
        await conversation.replace_in_window(plan.entries)
        try:
            await conversation.drop_spans(ranges)
        except KVShiftUnsupported as error:
            logger.warning("sliding window unavailable (%s); falling back to truncation", error)
            await conversation.realign(agent)
            return len(plan.entries), str(error)
        kept = covered - sum(end - start for start, end in ranges)
        _warn_if_misaligned(conversation, agent, kept)
        return len(plan.entries), None


def _warn_if_misaligned(conversation: ConversationView[AgentT], agent: AgentT, kept: int) -> None:
    """The remaining messages must render to the tokens the KV now holds; a template that
    renders a message differently once earlier ones are gone costs a re-prefill from there."""
    aligned = common_prefix_len(conversation.kv_tokens, conversation.render(agent).token_ids)
    if aligned < kept:
        logger.warning(
            "after the span drop the prompt diverges from the KV at token %d of %d (the chat "
            "template renders messages depending on earlier ones); re-prefilling from there",
            aligned,
            kept,
        )
