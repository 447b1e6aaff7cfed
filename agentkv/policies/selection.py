"""Which messages may leave the window, in which groups, and how many must go to meet a target.

Policies work in whole messages, grouped into *units* that leave together: an assistant tool
call with its tool results (an orphaned result breaks templates and confuses models), or a
single message. The newest user message and the latest unit are protected (the model must see
the question and the last tool results)::

    plan = plan_removal(conversation.window, conversation.render(agent), target=700)
    plan.entries          # the oldest removable units, in window order
    plan.token_ranges     # their spans in the rendered prompt, merged, in order
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentkv.chat.messages import Message

if TYPE_CHECKING:
    from agentkv.policies.protocol import Rendered, WindowItem


@dataclass(frozen=True)
class Unit:
    """Window entries ``first:end`` that leave the window together."""

    first: int
    end: int


def group_units(messages: Sequence[Message]) -> list[Unit]:
    """Split messages into units: an assistant message with tool calls plus the tool results
    after it, a run of tool results without their call, or one message."""
    units: list[Unit] = []
    i = 0
    while i < len(messages):
        j = i + 1
        message = messages[i]
        if message.role == "tool" or (message.role == "assistant" and message.tool_calls):
            while j < len(messages) and messages[j].role == "tool":
                j += 1
        units.append(Unit(i, j))
        i = j
    return units


def removable_units(messages: Sequence[Message]) -> list[Unit]:
    """Units that may leave, oldest first: all but the newest user message's and the last one."""
    units = group_units(messages)
    newest_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    protected = {len(units) - 1} if units else set()
    for position, unit in enumerate(units):
        if newest_user is not None and unit.first <= newest_user < unit.end:
            protected.add(position)
    return [unit for position, unit in enumerate(units) if position not in protected]


def unit_tokens(unit: Unit, rendered: Rendered) -> tuple[int, int]:
    """The unit's token range in ``rendered`` (span 0 is the system message, so window entry k
    is span k + 1)."""
    return rendered.spans[unit.first + 1].start, rendered.spans[unit.end].end


@dataclass(frozen=True)
class RemovalPlan:
    """The messages a compaction removes and what that saves."""

    entries: tuple[WindowItem, ...]
    """Entries to remove, in window order."""
    token_ranges: tuple[tuple[int, int], ...]
    """Their (start, end) token ranges in the rendered prompt, adjacent ones merged, in order."""
    tokens_before: int
    """Prompt tokens before removal."""
    tokens_after: int
    """Estimated prompt tokens after removal (from the spans)."""
    floor: int
    """Estimated prompt tokens if every removable unit left (protected messages only)."""


def plan_removal(
    window: Sequence[WindowItem], rendered: Rendered, *, target: int, reserve: int = 0
) -> RemovalPlan:
    """The oldest removable units whose removal brings ``rendered`` to ``target - reserve``
    tokens (``reserve``: tokens something will add back, e.g. a summary), or all of them."""
    units = removable_units([entry.message for entry in window])
    before = len(rendered.token_ids)
    lengths = [end - start for start, end in (unit_tokens(u, rendered) for u in units)]
    after, chosen = before, []
    for unit, length in zip(units, lengths):
        if after + reserve <= target:
            break
        chosen.append(unit)
        after -= length
    # Do not leave an answer whose question just left: take adjacent non-user units along.
    for unit in units[len(chosen) :] if chosen else ():
        if unit.first != chosen[-1].end or window[unit.first].message.role == "user":
            break
        chosen.append(unit)
        after -= unit_tokens(unit, rendered)[1] - unit_tokens(unit, rendered)[0]
    ranges: list[tuple[int, int]] = []
    for unit in chosen:
        start, end = unit_tokens(unit, rendered)
        if ranges and ranges[-1][1] == start:
            ranges[-1] = (ranges[-1][0], end)
        else:
            ranges.append((start, end))
    entries = tuple(window[i] for unit in chosen for i in range(unit.first, unit.end))
    return RemovalPlan(entries, tuple(ranges), before, after, before - sum(lengths))
