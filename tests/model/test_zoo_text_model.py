"""Streamed text equals a whole decode on the real detokenizers (issue 25 item 7): every family of
the zoo (tests/data/zoo; Gemma 3's vocabulary is SentencePiece-style: ``▁`` spaces, ``<0xNN>``
byte fallback) and the default model (SmolLM2, byte-level BPE).

Hypothesis draws id sequences — any id of the vocabulary (special and byte tokens included, so
characters are cut and broken), the ids of text with multi-byte characters, and both mixed — and
the deltas of ``IncrementalDecoder`` over the OpenVINO detokenizer must join to ``decode(ids)``,
with no U+FFFD in them when the whole decode has none. One generation per zoo family checks the
same through the engine: the streamed deltas and ``result.text`` equal the decode of the ids.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv import open_engine
from agentkv.engine.base import GenerationConfig
from agentkv.engine.decode.detokenize import REPLACEMENT, IncrementalDecoder
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.tokenizer import OVTokenizer

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "openvino_detokenizer.xml").is_file()) if ZOO.is_dir() else []
TOKENIZERS = [*FAMILIES, "default"]
ALPHABET = list("What is the canteal one short?  \t\né€☕😀ïß—") + ["<end_of_turn>", "<|im_end|>"]
_CACHE: dict[str, tuple[OVTokenizer, int]] = {}


def _tokenizer(name: str) -> tuple[OVTokenizer, int]:
    """The model's tokenizer and its vocabulary size (the zoo's from its vocabulary, the
    default model's from its GGUF; a byte-level detokenizer's vocabulary is not valid UTF-8)."""
    if name not in _CACHE:
        files = resolve_model(None if name == "default" else ZOO / name)
        tok = OVTokenizer(files.ir_dir)
        tokens = files.gguf_metadata().get("tokenizer.ggml.tokens")
        _CACHE[name] = tok, len(tokens) if tokens else _vocab_size(files.tokenizer_json() or "{}")
    return _CACHE[name]


def _vocab_size(tokenizer_json: str) -> int:
    """One more than the largest id of a ``tokenizer.json`` (its vocabulary and added tokens)."""
    data = json.loads(tokenizer_json)
    return 1 + max([*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])])


def stream(decode: Callable[[Sequence[int]], str], ids: Sequence[int]) -> list[str]:
    """The deltas an IncrementalDecoder streams for ``ids``, the flush last."""
    dec = IncrementalDecoder(decode)
    return [dec.push(i) for i in ids] + [dec.flush()]


@st.composite
def id_sequences(draw: st.DrawFn, tok: OVTokenizer, size: int) -> list[int]:
    """Random ids, the ids of random text, or runs of each, up to ~80 ids."""
    ids: list[int] = []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            ids += draw(st.lists(st.integers(0, size - 1), max_size=20))
        else:
            ids += tok.encode("".join(draw(st.lists(st.sampled_from(ALPHABET), max_size=40))))
    return ids


@pytest.mark.parametrize("name", TOKENIZERS)
def test_streamed_text_equals_the_whole_decode(name: str) -> None:
    tok, size = _tokenizer(name)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(ids=id_sequences(tok, size))
    def check(ids: list[int]) -> None:
        whole = tok.decode(ids)
        deltas = stream(tok.decode, ids)
        assert "".join(deltas) == whole
        if REPLACEMENT not in whole:
            assert not any(REPLACEMENT in d for d in deltas)

    check()


@pytest.mark.parametrize("name", TOKENIZERS)
def test_a_long_text_streams_back_whole(name: str) -> None:
    tok, _ = _tokenizer(name)
    text = (ZOO / "corpus.txt").read_text(encoding="utf-8")[:3000] + " é ☕ € — ï  two\tspaces 😀"
    ids = tok.encode(text)
    deltas = stream(tok.decode, ids)
    assert "".join(deltas) == tok.decode(ids) and REPLACEMENT not in "".join(deltas)


@pytest.mark.parametrize("family", FAMILIES)
async def test_generated_text_equals_the_decode_of_the_generated_ids(family: str) -> None:
    engine = open_engine(ZOO / family, num_slots=1, prefix_cache_bytes=0, kv_cache_bytes=8 << 20)
    session = await engine.open_session()
    prompt = engine.tokenizer.encode("What is the canteal one short? é ☕")
    config = GenerationConfig(max_new_tokens=48, ignore_eos=True, temperature=1.0, seed=7)
    run = session.stream(prompt, config)
    deltas = [d.text async for d in run]
    await session.close()
    assert run.result is not None and run.result.finish_reason == "length"
    whole = engine.tokenizer.decode(run.result.token_ids)
    assert "".join(deltas) == run.result.text == whole
