"""Incremental detokenisation that never emits broken UTF-8.

Byte-level BPE splits a multi-byte character over several tokens; decoding a prefix then
yields a replacement character (or nothing). ``IncrementalDecoder`` holds text back until
the characters are complete::

    dec = IncrementalDecoder(tokenizer.decode)
    for tok in ids:
        print(dec.push(tok), end="")
    print(dec.flush())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a stream of token ids into text deltas whose concatenation is ``decode(all ids)``."""

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._start = 0  # ids before _start are fully emitted; decoding restarts there
        self._emitted = ""  # text already emitted for ids[_start:]

    def push(self, token_id: int) -> str:
        """Add one id; return the newly completed text (may be empty)."""
        self._ids.append(int(token_id))
        text = self._decode(self._ids[self._start :])
        if text.endswith(REPLACEMENT) or not text.startswith(self._emitted):
            return ""  # an unfinished character: wait for its remaining bytes
        delta = text[len(self._emitted) :]
        self._emitted = text
        if len(self._ids) - self._start > 16 and self._ends_on_char_boundary(text):
            self._start = len(self._ids)
            self._emitted = ""
        return delta

    def _ends_on_char_boundary(self, text: str) -> bool:
        # NOTE: some detokenizers silently drop the bytes of an unfinished character, so a
        # clean-looking text is no proof. An ASCII last character that the last id alone also
        # ends with is one byte at the very end: the ids end on a character boundary.
        if not text or text[-1] >= "\x80":
            return False
        return self._decode(self._ids[-1:]).endswith(text[-1])

    def flush(self) -> str:
        """Whatever is still held back (a trailing incomplete character is emitted as is)."""
        text = self._decode(self._ids[self._start :])
        delta = text[len(self._emitted) :] if text.startswith(self._emitted) else ""
        self._start = len(self._ids)
        self._emitted = ""
        return delta
