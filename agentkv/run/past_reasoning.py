"""Drop a reasoning model's earlier thinking from the KV where its chat template leaves it out.

Qwen3's template shows the ``<think>`` block of assistant turns after the last user message
only; once the next user turn comes, the thinking of the turn before leaves the prompt while the
KV still holds it. Re-prefilling from there would re-read every later token; a span drop + RoPE
shift (``KVSession.drop``) removes just the block, so the next call prefills only the new turn::

    spans = left_out_reasoning(kv.tokens, prompt.token_ids, think_id, end_think_id)
    dropped = await drop_left_out_reasoning(conversation, agent, prompt)   # tokens dropped

Only ``<think>`` … ``</think>`` blocks (and the newlines after them) are ever dropped: any other
difference between the KV and the prompt is left to the session, which keeps the common prefix
and re-prefills the rest (a window policy that wants a shift asks for it itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentkv.agent import Agent
    from agentkv.chat.render import RenderedPrompt
    from agentkv.run.conversation import Conversation

MAX_NEWLINES_AFTER = 4
"""Most tokens after ``</think>`` (the newlines before the answer) that leave with the block."""


def left_out_reasoning(kv: Sequence[int], prompt: Sequence[int], think_id: int, end_think_id: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans of ``kv`` that are thinking blocks the prompt leaves out, in
    order: walking both, each place they differ must be a ``<think>`` block in the KV after which
    the KV goes on as the prompt does; the walk stops at the first other difference.
    ``left_out_reasoning([1, 7, 5, 8, 2], [1, 2, 3], think_id=7, end_think_id=8) == [(1, 4)]``."""
    spans: list[tuple[int, int]] = []
    i = j = 0
    while True:
        while i < len(kv) and j < len(prompt) and kv[i] == prompt[j]:
            i, j = i + 1, j + 1
        if i >= len(kv) or j >= len(prompt) or kv[i] != think_id or end_think_id not in kv[i:]:
            return spans
        close = i + list(kv[i:]).index(end_think_id)
        resume = next((end for end in range(close + 1, min(close + 2 + MAX_NEWLINES_AFTER, len(kv)))
                       if kv[end] == prompt[j]), None)
        if resume is None:
            return spans
        spans.append((i, resume))
        i = resume


async def drop_left_out_reasoning(conversation: Conversation, agent: Agent, prompt: RenderedPrompt) -> int:
    """Drop from ``conversation``'s KV the thinking blocks ``prompt`` leaves out (when the agent's
    ``past_reasoning`` is ``"shift"`` and the KV can shift); returns the tokens dropped."""
    tags = conversation.renderer.reasoning_tags
    if tags is None or agent.past_reasoning != "shift" or not conversation.supports_drop:
        return 0
    ids = [conversation.renderer.tokenizer.encode(tag) for tag in tags]
    if any(len(tag_ids) != 1 for tag_ids in ids):
        return 0
    spans = left_out_reasoning(conversation.kv_tokens, prompt.token_ids, ids[0][0], ids[1][0])
    dropped = sum(end - start for start, end in spans)
    if spans:
        await conversation.drop_spans(spans)
        conversation.call_checks.note(f"earlier thinking left out by the template: {dropped} tokens in "
                                      f"{len(spans)} block(s) dropped from the KV (span drop + RoPE shift)")
    return dropped
