"""Hide tool-call markup from streamed text: emit what precedes ``<tool_call>``, hold back what might start it
(a reasoning model's thinking goes apart first: ``VisibleTokens.step``).

::

    f = MarkupFilter("<tool_call>")
    f.feed("Sure. <tool")   # -> "Sure. "
    f.feed("_call>{...")    # -> ""   (everything after the tag is withheld)
    f.flush()               # -> ""   (held text that starts a line, "\\n<tool", was a tag cut off: dropped)
"""

from __future__ import annotations

from typing import Protocol

from agentkv.engine.generation import TokenDelta, TokenLogprob


class ThoughtSplitter(Protocol):
    """What ``VisibleTokens`` needs of ``agentkv.chat.reasoning.ReasoningSplitter``."""

    @property
    def thinking(self) -> bool: ...

    def feed(self, text: str) -> tuple[str, str]: ...

    def flush(self) -> tuple[str, str]: ...


def tag_start_at_end(text: str, tag: str) -> int:
    """Length of the longest proper prefix of ``tag`` that ``text`` ends with, 0 if none:
    ``tag_start_at_end("Sure. <to", "<tool_call>") == 3``."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:length]):
            return length
    return 0


def cut_tag_at_line_start(text: str, tag: str) -> int:
    """``tag_start_at_end`` when that start of ``tag`` stands alone at the start of its line
    (spaces aside), else 0: a tag the end of the text cut off, not prose
    (``cut_tag_at_line_start("Sure.\\n<tool", "<tool_call>") == 5``)."""
    length = tag_start_at_end(text, tag)
    before = text[: len(text) - length].rstrip(" \t")
    return length if length and (not before or before.endswith("\n")) else 0


class MarkupFilter:
    """Streams text up to the first occurrence of ``tag``; nothing after it."""

    def __init__(self, tag: str) -> None:
        self._tag = tag
        self._held = ""
        self._line = ""  # what was shown since the last newline
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
        keep = tag_start_at_end(buffer, self._tag)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        shown = buffer[: len(buffer) - keep]
        self._line = (self._line + shown).rpartition("\n")[2]
        return shown

    def flush(self) -> str:
        """Text held back at the end: shown unless it starts a line (then it is a tag the
        stream's end cut off, e.g. ``"\\n<tool"``)."""
        held, self._held = ("" if self.hit else self._held), ""
        return "" if cut_tag_at_line_start(self._line + held, self._tag) else held


class VisibleTokens:
    """Streamed token deltas → the text to show and the log-probabilities of the tokens behind it.

    A token's log-probability goes out with the first shown text at or after it; the tokens of
    hidden text (tool-call markup, held-back text the end drops) are hidden with it::

        visible = VisibleTokens(MarkupFilter("<tool_call>"))
        text, logprobs = visible.feed(delta)   # ("Sure. ", (TokenLogprob(...),))
        text, logprobs = visible.flush()

    With a ``ReasoningSplitter`` the thinking goes apart first (tool-call markup written while
    thinking is neither hidden from it nor ends the answer); its tokens' log-probabilities are
    not reported::

        visible = VisibleTokens(MarkupFilter("<tool_call>"), ReasoningSplitter(("<think>", "</think>")))
        thought, text, logprobs = visible.step(delta)
        thought, text, logprobs = visible.end()
    """

    def __init__(self, hide: MarkupFilter | None, reasoning: ThoughtSplitter | None = None) -> None:
        self._hide = hide
        self._reasoning = reasoning
        self._pending: list[TokenLogprob] = []

    def step(self, delta: TokenDelta) -> tuple[str, str, tuple[TokenLogprob, ...]]:
        """The thinking and the answer text of ``delta`` safe to show now, and the answer's
        log-probabilities."""
        if self._reasoning is None:
            return ("", *self.feed(delta))
        thought, answer = self._reasoning.feed(delta.text)
        if self._reasoning.thinking:  # NOTE: thinking tokens' log-probabilities are not the answer's
            self._pending.clear()
            return thought, "", ()
        return (thought, *self.feed(TokenDelta(delta.token_id, answer, delta.logprob)))

    def end(self) -> tuple[str, str, tuple[TokenLogprob, ...]]:
        """What ``step`` held back, at the end of the stream."""
        thought, answer = self._reasoning.flush() if self._reasoning is not None else ("", "")
        text, logprobs = self.feed(TokenDelta(-1, answer)) if answer else ("", ())
        tail, more = self.flush()
        return thought, text + tail, logprobs + more

    def feed(self, delta: TokenDelta) -> tuple[str, tuple[TokenLogprob, ...]]:
        """The text of ``delta`` safe to show now, and the log-probabilities that go with it."""
        if delta.logprob is not None:
            self._pending.append(delta.logprob)
        text = self._hide.feed(delta.text) if self._hide is not None else delta.text
        return text, self._release(text)

    def flush(self) -> tuple[str, tuple[TokenLogprob, ...]]:
        """Text held back at the end (``MarkupFilter.flush``), and its tokens' log-probabilities."""
        text = self._hide.flush() if self._hide is not None else ""
        return text, self._release(text)

    def _release(self, text: str) -> tuple[TokenLogprob, ...]:
        if not text:
            if self._hide is not None and self._hide.hit:
                self._pending.clear()
            return ()
        out, self._pending = tuple(self._pending), []
        return out
