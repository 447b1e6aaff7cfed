"""SummarizeAndReprefill: summarise the oldest messages with the model, replace them by one summary.

The summary is written by the same model in a scratch session (the conversation's KV is
untouched), chunk by chunk so the summariser never outgrows its own window, with a bounded
number of attempts per chunk; an empty or failed summary falls back to truncation. The
summary message (content ``"Summary of earlier conversation: …"``) takes the place of the
messages it replaces and records them (``WindowEntry.replaces``); the KV is then re-prefilled
from the system prompt, whose KV is still there (or in the prefix cache)::

    agent = Agent(name="chat", policy=SummarizeAndReprefill(max_summary_tokens=96))
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

from agentkv.chat.messages import Message
from agentkv.engine.base import GenerationConfig
from agentkv.errors import UserError
from agentkv.policies.base import DEFAULT_LOW_WATER, WindowPolicy, truncate
from agentkv.policies.selection import plan_removal
from agentkv.policies.summary_prompt import (
    SUMMARIZER_INSTRUCTIONS,
    SUMMARY_PREFIX,
    chunk_lines,
    chunk_request,
    clean_summary,
    transcript_lines,
)

if TYPE_CHECKING:
    from agentkv.policies.protocol import AgentT, ConversationView, ScratchSession

logger = logging.getLogger(__name__)

_PROMPT_OVERHEAD = 128
"""Tokens of the summariser's instructions and template around a chunk."""
_SUMMARY_MESSAGE_OVERHEAD = 16
"""Tokens the summary message adds beyond its text (prefix, role header)."""


class SummarizeAndReprefill(WindowPolicy):
    """Replace the oldest messages by a model-written summary, then re-prefill."""

    name = "summarize_and_reprefill"

    def __init__(
        self,
        *,
        low_water: float = DEFAULT_LOW_WATER,
        max_summary_tokens: int = 128,
        chunk_tokens: int = 768,
        max_attempts: int = 2,
        role: Literal["system", "user"] = "system",
    ) -> None:
        super().__init__(low_water=low_water)
        counts = {"max_summary_tokens": max_summary_tokens, "chunk_tokens": chunk_tokens, "max_attempts": max_attempts}
        for name, value in counts.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{name} must be a whole number >= 1, got {value!r} "
                                "(max_summary_tokens, chunk_tokens and max_attempts all are)")
        if role not in ("system", "user"):
            raise UserError(f"the summary's role must be 'system' or 'user', got {role!r}")
        self.max_summary_tokens = max_summary_tokens
        """Longest summary generated (per chunk; the last chunk's summary is the result)."""
        self.chunk_tokens = chunk_tokens
        """Most transcript tokens shown to the summariser at once."""
        self.max_attempts = max_attempts
        """Attempts per chunk (an empty answer or an error counts as a failed attempt)."""
        self.role = role
        """Role of the summary message."""

    async def _remove(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, target: int
    ) -> tuple[int, str | None]:
        reserve = self.max_summary_tokens + _SUMMARY_MESSAGE_OVERHEAD
        plan = plan_removal(conversation.window, conversation.render(agent), target=target, reserve=reserve)
        if not plan.entries:
            return 0, None
        summary = await self.summarize(conversation, [entry.message for entry in plan.entries])
        if summary is None:
            reason = f"no usable summary of {len(plan.entries)} messages after {self.max_attempts} attempts"
            logger.warning("%s; falling back to truncation", reason)
            await truncate(conversation, agent, plan)
            return len(plan.entries), reason
        message = Message(role=self.role, content=f"{SUMMARY_PREFIX} {summary}")
        tokens = conversation.message_tokens(message, position=1)
        await conversation.replace_in_window(plan.entries, message, token_count=tokens)
        await conversation.realign(agent)
        return len(plan.entries), None

    async def summarize(self, conversation: ConversationView[Any], messages: Sequence[Message]) -> str | None:
        """A summary of ``messages`` written in a scratch session, or None if every attempt on
        some chunk failed or came back empty."""
        # The prompt holds the summary so far and the chunk; the answer needs its own room.
        room = conversation.context_len - 2 * self.max_summary_tokens - _PROMPT_OVERHEAD
        budget = max(1, min(self.chunk_tokens, room))
        chunks = chunk_lines(transcript_lines(messages), conversation.tokenizer, budget)
        async with conversation.scratch() as scratch:
            summary = ""
            for chunk in chunks:
                request = chunk_request(chunk, summary)
                prompt = conversation.render_messages(
                    [Message.system(SUMMARIZER_INSTRUCTIONS), Message.user(request)]
                ).token_ids
                text = await self._attempt(scratch, prompt)
                if text is None:
                    return None
                summary = text
            return summary or None

    async def _attempt(self, scratch: ScratchSession, prompt: Sequence[int]) -> str | None:
        """Up to ``max_attempts`` generations (greedy first, then sampled); the first non-empty."""
        for attempt in range(self.max_attempts):
            config = GenerationConfig(
                max_new_tokens=self.max_summary_tokens,
                temperature=0.0 if attempt == 0 else 0.7,
                seed=attempt,
            )
            try:
                result = await scratch.generate(prompt, config)
            except Exception as error:  # noqa: BLE001 (a failed summary must not fail the run)
                logger.warning("summary attempt %d failed: %s", attempt + 1, error)
                continue
            text = clean_summary(result.text)
            if text:
                return text
            logger.warning("summary attempt %d came back empty", attempt + 1)
        return None
