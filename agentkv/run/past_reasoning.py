"""Drop a reasoning model's earlier thinking from the KV where its chat template leaves it out.

Qwen3's template shows the ``<think>`` block of assistant turns after the last user message
only; once the next user turn comes, the thinking of the turn before leaves the prompt while the
KV still holds it. Re-prefilling from there would re-read every later token; a span drop + RoPE
shift (``KVSession.drop``) removes just the block, so the next call prefills only the new turn::

    spans = left_out_reasoning(kv.tokens, prompt.token_ids, think_id, end_think_id)
    dropped = await drop_left_out_reasoning(conversation, agent, prompt)   # tokens dropped

Whether thinking leaves by a shift at all is ``Agent.past_reasoning``: ``"auto"`` shifts unless
the engine's numerics are exact (``open_engine(exact=True)`` promises bit-exact KV, and a shifted
KV is close to, not equal to, a fresh prefill), where it re-reads instead (``shifts_past_reasoning``).

Only ``<think>`` … ``</think>`` blocks (and the newlines after them) are ever dropped: any other
difference between the KV and the prompt is left to the session, which keeps the common prefix
and re-prefills the rest (a window policy that wants a shift asks for it itself).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentkv.engine.base import common_prefix_len
from agentkv.errors import KVShiftUnsupported

if TYPE_CHECKING:
    from agentkv.agent import Agent
    from agentkv.engine.base import Engine
    from agentkv.chat.render import ChatRenderer, RenderedPrompt
    from agentkv.run.conversation import Conversation

MAX_NEWLINES_AFTER = 4
"""Most tokens after ``</think>`` (the newlines before the answer) that leave with the block."""


def left_out_reasoning(kv: Sequence[int], prompt: Sequence[int], think_id: int, end_think_id: int
                       ) -> list[tuple[int, int]]:
    """See ``_walk``: the spans only."""
    return _walk(kv, prompt, think_id, end_think_id)[0]


def _walk(kv: Sequence[int], prompt: Sequence[int], think_id: int,
          end_think_id: int) -> tuple[list[tuple[int, int]], int]:
    """The ``(start, end)`` spans of ``kv`` that are thinking blocks the prompt leaves out, in
    order: walking both, each place they differ must be a ``<think>`` block in the KV after which
    the KV goes on as the prompt does; the walk stops at the first other difference.
    ``left_out_reasoning([1, 7, 5, 8, 2], [1, 2, 3], think_id=7, end_think_id=8) == [(1, 4)]``.
    Also returns how much of ``kv`` the walk covered (the spans included)."""
    spans: list[tuple[int, int]] = []
    i = j = 0
    while True:
        while i < len(kv) and j < len(prompt) and kv[i] == prompt[j]:
            i, j = i + 1, j + 1
        if i >= len(kv) or j >= len(prompt) or kv[i] != think_id or end_think_id not in kv[i:]:
            return spans, i
        close = i + list(kv[i:]).index(end_think_id)
        resume = next((end for end in range(close + 1, min(close + 2 + MAX_NEWLINES_AFTER, len(kv)))
                       if kv[end] == prompt[j]), None)
        if resume is None:
            return spans, i
        spans.append((i, resume))
        i = resume


def shifts_past_reasoning(agent: Agent, engine: Engine) -> bool:
    """Whether ``agent``'s earlier thinking leaves the KV by a shift on ``engine``: ``"shift"``,
    or ``"auto"`` on an engine whose numerics are not exact (``engine.exact``):
    ``shifts_past_reasoning(Agent(name="a"), open_engine(exact=True))`` → False."""
    if agent.past_reasoning == "auto":
        return not engine.exact
    return agent.past_reasoning == "shift"


def _tag_ids(renderer: ChatRenderer, agent: Agent, engine: Engine) -> tuple[int, int] | None:
    """The ids of the thinking tags when earlier thinking leaves the KV by a shift."""
    return renderer.reasoning_ids if shifts_past_reasoning(agent, engine) else None


def reusable_kv_len(renderer: ChatRenderer, agent: Agent, engine: Engine, kv: Sequence[int],
                    history: Sequence[int]) -> int:
    """How much of ``kv`` (a live KV, a snapshot's tokens) a conversation rendering ``history``
    can keep: the common prefix, and past it the thinking blocks the history leaves out and what
    follows them as the history does (the next model call drops the blocks by a shift):
    ``usable = reusable_kv_len(conversation.renderer, agent, conversation.engine, kv.tokens, history)``."""
    tag_ids = _tag_ids(renderer, agent, engine)
    if tag_ids is None:
        return common_prefix_len(kv, history)
    return _walk(kv, history, *tag_ids)[1]


async def drop_left_out_reasoning(conversation: Conversation, agent: Agent, prompt: RenderedPrompt) -> int:
    """Drop from ``conversation``'s KV the thinking blocks ``prompt`` leaves out (when the agent's
    thinking leaves by a shift, ``shifts_past_reasoning``, and the KV can shift); returns the
    tokens dropped. A model whose keys fit no RoPE rotation keeps its KV: the session then
    re-reads from the first block."""
    tag_ids = _tag_ids(conversation.renderer, agent, conversation.engine)
    if tag_ids is None or not conversation.supports_drop:
        return 0
    spans = left_out_reasoning(conversation.kv_tokens, prompt.token_ids, *tag_ids)
    dropped = sum(end - start for start, end in spans)
    if not spans:
        return 0
    try:
        await conversation.drop_spans(spans)
    except KVShiftUnsupported as error:
        conversation.call_checks.note(f"earlier thinking left out by the template is re-read, not shifted: {error}")
        return 0
    conversation.call_checks.note(f"earlier thinking left out by the template: {dropped} tokens in "
                                  f"{len(spans)} block(s) dropped from the KV (span drop + RoPE shift)")
    return dropped
