"""Decoding by joining token bytes gives the detokenizer model's text (issue 27 step 0).

``OVTokenizer.decode`` skips the detokenizer IR when the IR only joins its tokens' bytes
(``engine/openvino/token_text.py``). For the default model and every zoo family, the text of
single ids, of random id sequences and of encoded text with multi-byte characters must equal
openvino-genai's own ``Tokenizer.decode``; Gemma 3's detokenizer (``ByteFallback`` and a regex)
is not a joining one and keeps the model's decode.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.token_text import JoinedTokenText
from agentkv.engine.openvino.tokenizer import OVTokenizer

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "openvino_detokenizer.xml").is_file()) if ZOO.is_dir() else []
NOT_JOINING = {"gemma3"}
TEXT = "Hello, world! The café’s naïve crème — 東京 😀 ☕ € <|im_end|>\n\tdone."


def _tokenizer(name: str) -> OVTokenizer:
    return OVTokenizer(resolve_model(None if name == "default" else ZOO / name).ir_dir)


def _model_decode(tok: OVTokenizer, ids: list[int]) -> str:
    return str(tok._tok.decode([int(i) for i in ids], skip_special_tokens=False))


@pytest.mark.parametrize("name", [*FAMILIES, "default"])
def test_joined_token_bytes_decode_as_the_detokenizer_model_does(name: str) -> None:
    tok = _tokenizer(name)
    joined = tok._joined
    if name in NOT_JOINING:
        assert joined is None
        return
    assert joined is not None
    rng = np.random.default_rng(27)
    size = len(joined.vocab)
    singles = range(size) if size <= 4096 else [*range(300), *rng.choice(size, 3000, replace=False).tolist()]
    for i in singles:
        assert tok.decode([int(i)]) == _model_decode(tok, [int(i)]), i
    encoded = tok.encode(TEXT)
    sequences = [encoded[:n] for n in range(len(encoded) + 1)] + [encoded[n:] for n in range(len(encoded))]
    sequences += [rng.integers(0, size, int(rng.integers(1, 40))).tolist() for _ in range(300)]
    for ids in sequences:
        assert tok.decode(ids) == _model_decode(tok, ids), ids
    if name == "default":  # byte-level BPE round-trips any text
        assert tok.decode(encoded) == TEXT


def test_the_joined_path_leaves_split_characters_to_the_model() -> None:
    text = JoinedTokenText([b"a", "é".encode()[:1], "é".encode()[1:], b"\xff"])
    assert text.decode([0, 1, 2]) == "aé"
    assert text.decode([0, 1]) is None  # half a character: the model's replacement characters decide
    assert text.decode([3]) is None and text.decode([4]) is None and text.decode([-1]) is None
    assert text.decode([]) == ""


def test_the_vocabulary_loads_in_a_process_that_made_no_tokenizer_yet() -> None:
    # NOTE: the extension that defines VocabDecoder lives in the OpenVINO Core that read the IR; a
    # Core freed before the model took the op's code with it (a segfault on exit)
    xml = resolve_model(None).ir_dir / "openvino_detokenizer.xml"
    code = ("import sys; from pathlib import Path; from agentkv.engine.openvino.token_text import JoinedTokenText; "
            f"text = JoinedTokenText.load(Path({str(xml)!r})); print(len(text.vocab)); print(text.decode([28]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[0] == "49152"
