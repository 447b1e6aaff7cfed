"""The model's tokenizer through OVTokenizer: texts of any length encode whole."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


def test_the_tokenizer_counts_past_its_ir_limit_of_8192_tokens(engine_plain):
    text = " ".join(f"word{i}" for i in range(4000))  # ~19,000 tokens
    ids = engine_plain.tokenizer.encode(text)
    assert len(ids) > 8192 and engine_plain.tokenizer.decode(ids) == text
