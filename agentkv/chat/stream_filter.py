"""Hide tool-call markup from streamed text: emit what precedes ``<tool_call>``, hold back what might start it.

::

    f = MarkupFilter("<tool_call>")
    f.feed("Sure. <tool")   # -> "Sure. "
    f.feed("_call>{...")    # -> ""   (everything after the tag is withheld)
"""

from __future__ import annotations


class MarkupFilter:
    """Streams text up to the first occurrence of ``tag``; nothing after it."""

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """Return the part of ``text`` that is safe to show now."""
        if self.hit:
            return ""
        buffer = self._held + text
        at = buffer.find(self._tag)
        if at >= 0:
            self.hit = True
            self._held = ""
            return buffer[:at]
        keep = 0
        for n in range(min(len(self._tag) - 1, len(buffer)), 0, -1):
            if buffer.endswith(self._tag[:n]):
                keep = n
                break
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """Text held back at the end (it never became the tag)."""
        held, self._held = ("" if self.hit else self._held), ""
        return held
