"""Shared fixtures: real engines on the default model (compiled once per test session)."""

from __future__ import annotations

import pytest

from agentkv.engine.base import GenerationConfig


@pytest.fixture(scope="session")
def engine():
    """The default model and engine settings (f16 KV cache, this CPU's numerics), 4 slots."""
    from agentkv.engine.stateful import StatefulEngine

    return StatefulEngine(num_slots=4)


@pytest.fixture(scope="session")
def engine_f32():
    """The strict-invariant configuration: ``exact=True`` (f32 KV, f32 compute, no dynamic
    quantisation), so chunking moves logits by ~5e-5 on any CPU. No prefix cache: a hit would
    make a "one-pass prefill" reference not one-pass."""
    from agentkv.engine.stateful import StatefulEngine

    return StatefulEngine(num_slots=3, exact=True, prefix_cache_bytes=0)


@pytest.fixture(scope="session")
def engine_plain():
    """The default engine settings with no prefix cache: for references that must be a
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
