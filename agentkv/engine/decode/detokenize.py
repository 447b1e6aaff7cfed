"""Incremental detokenisation whose deltas join to the whole decode, never breaking UTF-8.

Byte-level BPE and SentencePiece byte fallback split a multi-byte character over several
tokens; decoding a prefix then yields a replacement character (or nothing). A SentencePiece
decoder also strips the leading space of a sequence's first token, so a window decoded from
mid-text alone loses its space. ``IncrementalDecoder`` holds text back until the characters
are complete, and decodes each window with one already-emitted token before it::

    dec = IncrementalDecoder(tokenizer.decode)
    text = "".join(dec.push(tok) for tok in ids) + dec.flush()
    assert text == tokenizer.decode(ids)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
WINDOW = 16
"""Ids decoded per push before the window may restart (the per-token cost is one call of the
detokenizer, nearly all of it call overhead: a shorter window buys almost nothing)."""


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas whose concatenation is ``decode(all ids)``.

    Each push decodes ``ids[start:]``; ``ids[start]`` is either the first id or one context id
    whose text was already emitted, so the window decodes as it does inside the whole text (a
    SentencePiece leading space is stripped from the context id, not from the new one). The
    window restarts at the last id once it passes ``window`` ids and that id alone decodes to
    complete characters: ``IncrementalDecoder(tok.decode).push(7)``.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], *, window: int = WINDOW) -> None:
        self._decode = decode
        self._window = window
        self._ids: list[int] = []
        self._start = 0  # the window's first id: the first id, or a context id already emitted
        self._emitted = ""  # text of ids[_start:] emitted so far, the context id's included

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (may be empty): ``dec.push(42)``."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._start :])
        if text.endswith(REPLACEMENT) or not text.startswith(self._emitted):
            return ""  # an unfinished character: wait for its remaining bytes
        delta = text[len(self._emitted) :]
        self._emitted = text
        if len(self._ids) - self._start > self._window:
            self._restart_at_last(text)
        return delta

    def _restart_at_last(self, text: str) -> None:
        """Make the last id the next window's context, if it is whole characters on its own.

        Its text alone must be non-empty, hold no U+FFFD and end the window's text: then its
        bytes start and end on character boundaries (a detokenizer that drops an unfinished
        character's bytes keeps them in the context id, so they still join the next bytes),
        and a stripped leading space is stripped from it in both decodes alike.
        """
        piece = self._decode(self._ids[-1:])
        if piece and REPLACEMENT not in piece and text.endswith(piece):
            self._start = len(self._ids) - 1
            self._emitted = piece

    def flush(self) -> str:
        """Whatever is still held back (a trailing incomplete character is emitted as is):
        ``dec.flush()``. Later pushes continue the same text (a fresh one after a cut character)."""
        if len(self._ids) == self._start:
            return ""
        text = self._decode(self._ids[self._start :])
        delta = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._start, self._emitted = len(self._ids), ""
        self._restart_at_last(text)
        return delta
