"""The model's tokenizer: openvino-genai's Tokenizer behind the small ``Tokenizer`` protocol.

``tok = OVTokenizer(files.ir_dir); ids = tok.encode("hi"); tok.decode(ids)``;
``tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)``;
``read_chat_template(ir_dir)``: the template the runtime renders with, without an ``OVTokenizer``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import openvino_genai

from agentkv.engine.openvino.token_text import JoinedTokenText

PIECE_CHARS = 4096
"""Texts longer than this are encoded in pieces: the tokenizer IR silently stops at 8,192 tokens."""
_SAFE_CUT = re.compile(r"(?<=\S) (?=\S)")
"""A single space between two non-spaces: every byte-level pre-tokenizer starts a token there,
so encoding the pieces on either side gives the same ids as encoding the whole."""


class OVTokenizer:
    """Encode, decode and render chat templates with the model's own tokenizer."""

    def __init__(self, ir_dir: Path) -> None:
        self._tok = _open(ir_dir)
        self._joined = JoinedTokenText.load(Path(ir_dir) / "openvino_detokenizer.xml")
        """Token bytes when the detokenizer only joins them (decoding then skips the model call)."""
        self.eos_token_id: int = int(self._tok.get_eos_token_id())
        self.bos_token_id: int = int(self._tok.get_bos_token_id())

    @property
    def chat_template(self) -> str:
        """The Jinja chat template shipped with the model (see ``read_chat_template``)."""
        return _template_of(self._tok)

    def encode(self, text: str) -> list[int]:
        """Ids for ``text``; no BOS/EOS added (chat templates add their own markers). Any length:
        long texts are encoded piece by piece, cut where a token starts anyway."""
        return [i for piece in _pieces(text, PIECE_CHARS) for i in self._encode_piece(piece)]

    def _encode_piece(self, text: str) -> list[int]:
        if not text:
            return []
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False).input_ids.data[0]]

    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``, special tokens kept (so rendered prompts round-trip). When the
        detokenizer IR only joins token bytes, joined in Python (``token_text``): the same text,
        without a model call per streamed token."""
        if self._joined is not None:
            text = self._joined.decode(ids)
            if text is not None:
                return text
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=False))

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """Render ``messages`` (OpenAI-style dicts) with the model's template."""
        return str(
            self._tok.apply_chat_template(
                list(messages), add_generation_prompt=add_generation_prompt, tools=tools
            )
        )


def read_chat_template(ir_dir: Path) -> str:
    """The chat template the runtime renders ``ir_dir``'s conversations with ('' when none), read
    by openvino-genai as ``OVTokenizer`` reads it: the tokenizer IR's ``chat_template`` rt_info
    first, then ``chat_template.jinja`` (transformers ≥ 4.50 exports), then ``tokenizer_config.json``.
    Compiles the tokenizer IRs (~0.3 s), nothing else:
    ``read_chat_template(Path("tests/data/zoo/mistral_nemo_jinja")).startswith("{%-")``."""
    return _template_of(_open(ir_dir))


def _open(ir_dir: Path) -> openvino_genai.Tokenizer:
    return openvino_genai.Tokenizer(str(ir_dir))


def _template_of(tok: openvino_genai.Tokenizer) -> str:
    return str(tok.chat_template or "")


def _pieces(text: str, size: int) -> Iterator[str]:
    """``text`` cut into pieces of at most ~``size`` characters at safe cuts (a piece with no
    safe cut in reach is left whole)."""
    start = 0
    while len(text) - start > size:
        cut = None
        for match in _SAFE_CUT.finditer(text, start + 1, start + size):
            cut = match.start()
        if cut is None:
            later = _SAFE_CUT.search(text, start + size)
            if later is None:
                break
            cut = later.start()
        yield text[start:cut]
        start = cut
    yield text[start:]
