"""IncrementalDecoder: the deltas it streams join to the whole decode of the same ids.

Two fake vocabularies stand in for the real detokenizers (the real ones are checked in
tests/model/test_zoo_text_model.py): a SentencePiece-like one (``▁`` for a space, ``<0xNN>``
byte fallback, and the decoder's strip of the first token's leading space, as the real Gemma 3
decodes — issue 25 item 7) and a byte-level BPE one (pieces are raw bytes, some of them a cut
multi-byte character), decoded with U+FFFD for broken bytes or, as some detokenizers do, with
broken bytes dropped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.decode.detokenize import REPLACEMENT, WINDOW, IncrementalDecoder

SPACE = "\u2581"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
SP_VOCAB = ["<bos>", "<eos>", *BYTES, SPACE, SPACE * 2, f"{SPACE}the", f"{SPACE}can", "teal", f"{SPACE}one",
            f"{SPACE}short", "What", f"{SPACE}is", f"{SPACE}a", "s", "t", "e", f"{SPACE}caf", "é", f"{SPACE}☕"]


class FakeSentencePiece:
    """A SentencePiece-style tokenizer: greedy longest-piece encoding with byte fallback;
    decoding maps ``▁`` to a space, decodes runs of byte tokens as UTF-8 (U+FFFD for broken
    bytes) and strips one leading space, as SentencePiece does."""

    def __init__(self, vocab: Sequence[str] = SP_VOCAB) -> None:
        self.vocab = list(vocab)
        self._ids = {piece: i for i, piece in enumerate(self.vocab)}

    def encode(self, text: str) -> list[int]:
        """``FakeSentencePiece().encode("What is") == [ids of "What", "▁is"]``."""
        rest, ids = text.replace(" ", SPACE), []
        while rest:
            piece = max((p for p in self._ids if not p.startswith("<") and rest.startswith(p)), key=len, default="")
            if piece:
                ids.append(self._ids[piece])
                rest = rest[len(piece):]
            else:
                ids.extend(self._ids[f"<0x{b:02X}>"] for b in rest[0].encode())
                rest = rest[1:]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """``FakeSentencePiece().decode(FakeSentencePiece().encode(" the")) == "the"``."""
        out: list[str] = []
        run = bytearray()
        for piece in (self.vocab[i] for i in ids):
            if piece in BYTES:
                run.append(int(piece[3:5], 16))
                continue
            out.append(run.decode("utf-8", "replace"))
            run.clear()
            out.append(piece.replace(SPACE, " "))
        text = "".join(out) + run.decode("utf-8", "replace")
        return text[1:] if text.startswith(" ") else text


BPE_VOCAB = [bytes([b]) for b in range(256)] + [
    b" the", b" can", b"teal", b" one", b" short", b"What", b" is", b"\xc3\xa9", b"\xe2\x82", b"\xac ", b" \xe2",
    b"\x98\x95", b"\xf0\x9f", b"\x98\x80!", b"a\xc3"]


def byte_level(errors: str) -> Callable[[Sequence[int]], str]:
    """A byte-level BPE decode: the pieces' bytes joined, broken bytes replaced or dropped."""
    return lambda ids: b"".join(BPE_VOCAB[i] for i in ids).decode("utf-8", errors)


def bpe_encode(text: str) -> list[int]:
    """Greedy longest-piece byte-level encoding over ``BPE_VOCAB``."""
    rest, ids = text.encode(), []
    while rest:
        i = max((i for i, p in enumerate(BPE_VOCAB) if rest.startswith(p)), key=lambda i: len(BPE_VOCAB[i]))
        ids.append(i)
        rest = rest[len(BPE_VOCAB[i]):]
    return ids


def stream(decode: Callable[[Sequence[int]], str], ids: Sequence[int], window: int = WINDOW) -> list[str]:
    """The deltas an IncrementalDecoder gives for ``ids``, the flush last."""
    dec = IncrementalDecoder(decode, window=window)
    return [dec.push(i) for i in ids] + [dec.flush()]


SENTENCE = "What is the canteal one short " * 4 + "What is a caf" + "é ☕"


def test_a_sentencepiece_leading_space_survives_the_window_restart() -> None:
    tok = FakeSentencePiece()
    ids = tok.encode(SENTENCE)
    assert len(ids) > 2 * WINDOW and tok.decode(ids) == SENTENCE
    assert "".join(stream(tok.decode, ids)) == SENTENCE  # before the fix: "… What isa café ☕"


@pytest.mark.parametrize("window", [1, 2, WINDOW])
def test_every_window_length_joins_to_the_whole_decode(window: int) -> None:
    tok = FakeSentencePiece()
    assert "".join(stream(tok.decode, tok.encode(SENTENCE), window)) == SENTENCE
    assert "".join(stream(byte_level("replace"), bpe_encode(SENTENCE), window)) == SENTENCE


def test_a_character_split_over_byte_tokens_is_emitted_whole_by_the_token_that_ends_it() -> None:
    tok = FakeSentencePiece()
    ids = tok.encode("What is €")  # What, ▁is, ▁, <0xE2>, <0x82>, <0xAC>
    assert len(ids) == 6
    assert stream(tok.decode, ids, window=1) == ["What", " is", " ", "", "", "€", ""]


def test_a_cut_character_at_the_end_is_flushed_as_the_whole_decode_gives_it() -> None:
    tok = FakeSentencePiece()
    ids = tok.encode("is €")[:-1]
    deltas = stream(tok.decode, ids, window=1)
    assert deltas[-1] == REPLACEMENT and "".join(deltas) == tok.decode(ids) == "is " + REPLACEMENT


def test_pushing_after_a_flush_continues_the_same_text() -> None:
    tok = FakeSentencePiece()
    ids = tok.encode("What is the can")
    dec = IncrementalDecoder(tok.decode)
    text = "".join(dec.push(i) for i in ids[:3]) + dec.flush()
    text += "".join(dec.push(i) for i in ids[3:]) + dec.flush()
    assert text == "What is the can"


TEXTS = st.text(alphabet=st.sampled_from(list("What is the canteal one short a  é€☕😀!\n")), max_size=120)


@settings(max_examples=300, deadline=None)
@given(text=TEXTS, window=st.sampled_from([1, 3, WINDOW]))
def test_text_streams_back_whole_with_no_replacement_character(text: str, window: int) -> None:
    tok = FakeSentencePiece()
    deltas = stream(tok.decode, tok.encode(text), window)
    assert "".join(deltas) == tok.decode(tok.encode(text)) and REPLACEMENT not in "".join(deltas)
    for errors in ("replace", "ignore"):
        deltas = stream(byte_level(errors), bpe_encode(text), window)
        assert "".join(deltas) == text


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(0, len(SP_VOCAB) - 1), max_size=60), window=st.sampled_from([1, 3, WINDOW]))
def test_random_sentencepiece_ids_join_to_the_whole_decode(ids: list[int], window: int) -> None:
    tok = FakeSentencePiece()
    assert "".join(stream(tok.decode, ids, window)) == tok.decode(ids)


@settings(max_examples=400, deadline=None)
@given(ids=st.lists(st.integers(0, len(BPE_VOCAB) - 1), max_size=60), window=st.sampled_from([1, 3, WINDOW]),
       errors=st.sampled_from(["replace", "ignore"]))
def test_random_byte_level_ids_join_to_the_whole_decode(ids: list[int], window: int, errors: str) -> None:
    decode = byte_level(errors)
    assert "".join(stream(decode, ids, window)) == decode(ids)
