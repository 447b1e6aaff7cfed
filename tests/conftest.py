"""Shared fixtures: real engines on the default model (compiled once per test session)."""

from __future__ import annotations

import pytest

from agentkv.engine.base import GenerationConfig


@pytest.fixture(scope="session")
def engine():
    """The default model with the plugin's default (u8) KV cache, 4 slots."""
    from agentkv.engine.stateful import StatefulEngine

    return StatefulEngine(num_slots=4)


@pytest.fixture(scope="session")
def engine_f32():
    """The default model with an f32 KV cache (the strict-invariant configuration). No prefix
    cache: its f16 snapshots would make a "one-pass prefill" reference not one-pass."""
    from agentkv.engine.stateful import StatefulEngine

    return StatefulEngine(num_slots=3, kv_cache_precision="f32", prefix_cache_bytes=0)


@pytest.fixture(scope="session")
def engine_plain():
    """The default model and KV precision with no prefix cache: for references that must be a
    genuine one-pass prefill and for comparisons with LLMPipeline, which has no prefix cache."""
    from agentkv.engine.stateful import StatefulEngine

    return StatefulEngine(num_slots=2, prefix_cache_bytes=0)


@pytest.fixture
def chat_ids(engine):
    """Render a one-turn chat prompt to ids: ``chat_ids("hi")``."""

    def render(question: str, system: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return engine.tokenizer.encode(text)

    return render


GREEDY = GenerationConfig(max_new_tokens=24)
