"""A rendered conversation: its token ids and where each message's tokens are (``RenderedPrompt``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class MessageSpan:
    """Where one message's tokens are in a rendered prompt."""

    index: int
    """Position of the message in the rendered list."""
    role: str
    """The message's role (``"tool"`` even when rendered as a user turn)."""
    start: int
    """First token of the message (inclusive)."""
    end: int
    """One past its last token."""

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RenderedPrompt:
    """A conversation as token ids: synthetic prefix, one span per message, generation prompt."""

    token_ids: tuple[int, ...]
    spans: tuple[MessageSpan, ...]
    """One per message, in order, contiguous; from the end of the synthetic prefix to the start
    of the generation prompt."""
    prefix_len: int
    """End of the leading system message (tools text included) or of the synthetic prefix; 0 if
    neither exists. The ids every conversation of the same agent starts with."""
    generation_prompt_len: int
    """Tokens of the trailing assistant header (0 without a generation prompt)."""


@dataclass(frozen=True)
class Entry:
    """One message as the template sees it."""

    payload: dict[str, Any]
    """The dict passed to the template."""
    index: int | None
    """Position in the caller's list; None for the system message created for the tools text."""
    role: str
    token_ids: tuple[int, ...] | None
    calls_payload: dict[str, Any] | None = None
    """For a generated assistant message with tool calls, when the template renders calls itself:
    the dict with its calls as ``tool_calls`` (``payload`` shows them as text). A template that
    tells calling messages apart (Mistral's skips them in its role-alternation check) may refuse
    the conversation without it."""


def ends_prefix(entry: Entry) -> bool:
    """The entry closes the prefix every conversation of an agent shares: the system message made
    for the tools text, or the caller's leading system message."""
    return entry.index is None or (entry.index == 0 and entry.role == "system")
