"""GeneratedMarkers: the markers that stand for generated messages while a whole conversation is
rendered (``chat/render_whole.py``), and the texts to put back; the calls' text is found after
what the messages before them render, so a message that quotes a call keeps its own text::

    markers.substitute(template.apply(dicts, generation=True, tools=tools))
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GeneratedMarkers:
    """The markers standing for generated messages, and the texts to put back."""

    ids: dict[str, tuple[int, ...]]
    """Marker → the ids it stands for."""
    shown: dict[str, str]
    """A reasoning message's thinking as the template shows it → the marker of the whole message."""
    markers: tuple[tuple[str, ...], ...]
    """Per generated message, the markers one of which its rendering holds."""
    written: tuple[tuple[int, str, str, int], ...] = ()
    """Per generated message the template was shown as tool calls: its position among the dicts,
    the text its ids decode to (what the template renders for those calls), its marker, and how
    many times that text occurs in the rendering of the messages before it (a user or tool message
    quoting the call: those occurrences are not the message's)."""

    def substitute(self, text: str | None) -> str | None:
        """``text`` with every thinking the template shows replaced by its whole message's marker,
        and the text of each message shown as calls by its marker, at its first occurrence after
        those the messages before it hold."""
        if text is None:
            return None
        for shown, whole in self.shown.items():
            text = text.replace(shown, whole)
        for _, written, marker, before in self.written:
            text = _replace_nth(text, written, marker, before)
        return text

    def written_at(self, position: int) -> tuple[str, str] | None:
        """(text, marker) of the message at ``position`` when it is shown as calls, else None."""
        return next(((text, marker) for i, text, marker, _ in self.written if i == position), None)

    def contents(self, position: int, payload: dict[str, Any]) -> list[str]:
        """The texts the message at ``position`` may appear as in a rendering: its content as
        given, or, for a reasoning model's message, its whole message's marker; the marker alone
        for a message shown as calls."""
        written = self.written_at(position)
        if written is not None:
            return [written[1]]
        content = payload.get("content")
        if not isinstance(content, str) or not content:
            return []
        return [content, *([self.shown[content]] if content in self.shown else [])]


def _replace_nth(text: str, old: str, new: str, skip: int) -> str:
    """``text`` with the occurrence of ``old`` after its first ``skip`` ones replaced by ``new``:
    ``_replace_nth("a b a", "a", "X", 1) == "a b X"``."""
    at = -1
    for _ in range(skip + 1):
        at = text.find(old, at + 1)
        if at < 0:
            return text
    return text[:at] + new + text[at + len(old):]
