"""Messages too large for the window: a named error, or (if the agent opts in) a visible cut.

When the protected messages (system prompt, newest user message, latest tool results) alone
exceed the budget, no amount of removal helps. By default that raises
``ContextOverflowError``; with ``Agent(truncate_oversized_messages=True)`` the largest protected
user or tool message is cut — its head and tail kept around a marker — and the cut version
replaces it in the window (the original stays in the store)::

    await fit_oversized(conversation, agent, limit=1792, target=1254)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agentkv.errors import ContextOverflowError
from agentkv.policies.selection import plan_removal, removable_units

if TYPE_CHECKING:
    from collections.abc import Sequence

    from agentkv.chat.messages import Message
    from agentkv.policies.protocol import AgentT, ConversationView, TextTokenizer, TokenSpan

CUTTABLE_ROLES = ("user", "tool")
_MAX_CUTS = 8
_SLACK_TOKENS = 8  # re-tokenising the joined text may merge or split a few tokens


def truncation_marker(removed_tokens: int) -> str:
    """The text that marks a cut: ``truncation_marker(120) == "\\n[… 120 tokens truncated …]\\n"``."""
    return f"\n[… {removed_tokens} tokens truncated …]\n"


def cut_content(tokenizer: TextTokenizer, content: str, remove: int) -> str:
    """``content`` with at least ``remove`` tokens (plus the marker's own) taken out of its
    middle; the head and tail are kept."""
    ids = tokenizer.encode(content)
    marker_len = len(tokenizer.encode(truncation_marker(len(ids))))
    keep = max(0, len(ids) - remove - marker_len - _SLACK_TOKENS)
    head, tail = (keep + 1) // 2, keep // 2
    kept_tail = ids[len(ids) - tail :] if tail else []
    removed = len(ids) - head - tail
    return tokenizer.decode(ids[:head]) + truncation_marker(removed) + tokenizer.decode(kept_tail)


async def fit_oversized(conversation: ConversationView[AgentT], agent: AgentT, *, limit: int, target: int) -> int:
    """Make the protected messages fit ``limit`` (cutting down to halfway between ``target``
    and ``limit``); return how many messages were cut. Raises ``ContextOverflowError`` when they
    do not fit and the agent did not opt into cutting, or when cutting cannot make them fit."""
    cuts = 0
    for _ in range(_MAX_CUTS):
        rendered = conversation.render(agent)
        floor = plan_removal(conversation.window, rendered, target=0).floor
        if floor <= limit:
            return cuts
        candidate = _largest_protected(conversation.messages, rendered.spans)
        if not agent.truncate_oversized_messages or candidate is None:
            raise _overflow(floor, limit, candidate is None)
        index, length = candidate
        entry = conversation.window[index]
        # NOTE: cut only down to halfway between the low-water mark and the limit: a cut loses
        # content for good (in the window), so it takes no more than the budget needs.
        excess = floor - max((target + limit) // 2, 1)
        new_content = cut_content(conversation.tokenizer, entry.message.content, min(excess, length))
        if new_content == entry.message.content:
            break
        cut = entry.message.model_copy(update={"content": new_content})
        tokens = conversation.message_tokens(cut, position=index + 1)
        await conversation.replace_in_window([entry], cut, token_count=tokens)
        cuts += 1
    rendered = conversation.render(agent)
    floor = plan_removal(conversation.window, rendered, target=0).floor
    if floor > limit:
        raise _overflow(floor, limit, True)
    return cuts


def _largest_protected(messages: Sequence[Message], spans: Sequence[TokenSpan]) -> tuple[int, int] | None:
    """(window index, span length) of the largest protected user/tool message with content
    (``spans``: the rendered prompt's, span 0 being the system prompt)."""
    removable = {i for unit in removable_units(messages) for i in range(unit.first, unit.end)}
    best: tuple[int, int, tuple[int, bool]] | None = None
    for index, message in enumerate(messages):
        if index in removable or message.role not in CUTTABLE_ROLES or not message.content:
            continue
        length = len(spans[index + 1])
        rank = (length, message.role == "tool")  # the largest; on a tie, a tool result first
        if best is None or rank > best[2]:
            best = (index, length, rank)
    return None if best is None else best[:2]


def _overflow(floor: int, limit: int, exhausted: bool) -> ContextOverflowError:
    if exhausted:
        advice = "shorten the system prompt or that message, or raise max_prompt_len"
    else:
        advice = "set Agent(truncate_oversized_messages=True) to cut it, or raise max_prompt_len"
    return ContextOverflowError(
        f"the messages that must stay in the window (system prompt, newest user turn, latest "
        f"tool results) take {floor} tokens, over the budget of {limit}; {advice}",
        prompt_tokens=floor,
        limit=limit,
    )

