"""Decode token ids without calling the detokenizer model when its IR provably only joins token bytes.

openvino-genai's ``Tokenizer.decode`` runs the detokenizer IR: ~0.2–0.5 ms per call, nearly all
of it call overhead, paid for every streamed token. Most detokenizers are a ``VocabDecoder``
(each id's bytes, from constants in the IR) whose pieces are joined (``FuzeRagged``) and checked
as UTF-8 (``UTF8Validate``: an identity on valid UTF-8). For such an IR the text of ``ids`` is the
join of their bytes, decoded as UTF-8; ``JoinedTokenText`` reads the vocabulary once and does
that in Python. An IR with any other step (a SentencePiece ``RegexNormalization``, ``ByteFallback``,
clean-up of spaces) is not used this way (``JoinedTokenText.load`` returns None), and bytes that
are not valid UTF-8 (a character split across tokens) are left to the model's decode, whose
replacement characters are its own::

    text = JoinedTokenText.load(ir_dir / "openvino_detokenizer.xml")
    if text is not None:
        text.decode([9690, 28]) # "Hello," — or None: ask the detokenizer model
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np

AFTER_DECODER = ("FuzeRagged", "UTF8Validate", "StringTensorPack", "Result")
"""Every op downstream of the ``VocabDecoder``, one each, fed by it and each other only: join the
pieces, check UTF-8, pack the text."""
BEFORE_DECODER = frozenset({"Parameter", "Constant", "Convert", "Slice"})
"""What may feed the ``VocabDecoder``: the ids (converted) and the list of skipped tokens (sliced
constants; we never skip)."""


@cache
def _core() -> Any:
    """One OpenVINO Core for the process: the openvino_tokenizers extension it loads must outlive
    every model read through it (a freed Core takes the ``VocabDecoder`` op's code with it)."""
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers VocabDecoder & co. with OpenVINO)

    return ov.Core()


class JoinedTokenText:
    """The bytes of every token of a joining detokenizer; ``decode(ids)`` → text, or None."""

    def __init__(self, vocab: Sequence[bytes]) -> None:
        self.vocab: tuple[bytes, ...] = tuple(vocab)

    @classmethod
    def load(cls, detokenizer_xml: Path) -> JoinedTokenText | None:
        """The vocabulary of ``detokenizer_xml`` when the IR only joins token bytes, else None
        (also when it cannot be read: the model's decode is then used as before)."""
        if not detokenizer_xml.is_file():
            return None
        try:
            return _read_joining_vocab(_core().read_model(str(detokenizer_xml)))
        except Exception:  # NOTE: only a shortcut: any IR it does not understand keeps the model's decode
            return None

    def decode(self, ids: Sequence[int]) -> str | None:
        """The text of ``ids`` (special tokens' text included), or None when an id is outside the
        vocabulary or the joined bytes are not valid UTF-8."""
        vocab, size = self.vocab, len(self.vocab)
        if not all(0 <= i < size for i in ids):
            return None
        try:
            return b"".join([vocab[i] for i in ids]).decode("utf-8")
        except UnicodeDecodeError:
            return None


def _read_joining_vocab(model: Any) -> JoinedTokenText | None:
    """The vocabulary of a detokenizer model shaped ``ids → VocabDecoder → FuzeRagged →
    UTF8Validate → StringTensorPack → Result`` with constant token bytes, else None."""
    decoders = [op for op in model.get_ordered_ops() if op.get_type_name() == "VocabDecoder"]
    if len(decoders) != 1:
        return None
    decoder = decoders[0]
    downstream, frontier = {decoder}, [decoder]
    while frontier:
        for out in frontier.pop().outputs():
            for target in out.get_target_inputs():
                if target.get_node() not in downstream:
                    downstream.add(target.get_node())
                    frontier.append(target.get_node())
    after = downstream - {decoder}
    if sorted(op.get_type_name() for op in after) != sorted(AFTER_DECODER):
        return None
    if any(value.get_node() not in downstream for op in after for value in op.input_values()):
        return None  # something else mixed into the text on its way out
    if any(not _fed_by(value.get_node(), BEFORE_DECODER) for value in decoder.input_values()):
        return None
    sources = [decoder.input_value(i).get_node() for i in (1, 2, 3)]  # begins, ends, chars
    if any(source.get_type_name() != "Constant" for source in sources):
        return None
    begins, ends, chars = (source.get_data() for source in sources)
    if chars.dtype != np.uint8 or begins.dtype.kind not in "iu" or ends.dtype.kind not in "iu":
        return None
    raw = chars.tobytes()
    return JoinedTokenText([raw[int(b):int(e)] for b, e in zip(begins, ends)])


def _fed_by(node: Any, allowed: frozenset[str]) -> bool:
    """True when ``node`` and everything upstream of it is one of ``allowed``."""
    if node.get_type_name() not in allowed:
        return False
    return all(_fed_by(value.get_node(), allowed) for value in node.input_values())
