"""The model's tokenizer: openvino-genai's Tokenizer behind the small ``Tokenizer`` protocol.

``tok = OVTokenizer(files.ir_dir); ids = tok.encode("hi"); tok.decode(ids)``;
``tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import openvino_genai


class OVTokenizer:
    """Encode, decode and render chat templates with the model's own tokenizer."""

    def __init__(self, ir_dir: Path) -> None:
        self._tok = openvino_genai.Tokenizer(str(ir_dir))
        self.eos_token_id: int = int(self._tok.get_eos_token_id())
        self.bos_token_id: int = int(self._tok.get_bos_token_id())

    @property
    def chat_template(self) -> str:
        """The Jinja chat template shipped with the model."""
        return str(self._tok.chat_template)

    def encode(self, text: str) -> list[int]:
        """Ids for ``text``; no BOS/EOS added (chat templates add their own markers)."""
        if not text:
            return []
        return [int(t) for t in self._tok.encode(text, add_special_tokens=False).input_ids.data[0]]

    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``, special tokens kept (so rendered prompts round-trip)."""
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
