"""The realistic-size model on the real engine (slow: builds the Qwen2.5-1.5B shape when missing, ~5-10
min and ~1 GB in the user cache, or uses the built one): it opens on the default engine and generates."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

pytestmark = [pytest.mark.model, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
NAME = "qwen2.5-1.5b-shape"


async def test_the_built_model_opens_on_the_default_engine_and_generates():
    from agentkv.chat.messages import Message
    from agentkv.chat.render import ChatRenderer
    from agentkv.engine.base import GenerationConfig
    from agentkv.engine.factory import open_engine

    resolver = runpy.run_path(str(ROOT / "benchmarks" / "_sized_models.py"))
    path = resolver["sized_model_dir"](NAME)  # builds it when missing
    engine = open_engine(path, kv_cache_bytes=64 << 20, num_slots=1)
    try:
        assert engine.kv_bytes_per_token() in (28_672, 57_344)  # 16-bit blocks (f32 under exact)
        prompt = ChatRenderer(engine.tokenizer).render([Message.user("Say something.")]).token_ids
        assert prompt[0] == 151644  # <|im_start|> at its real id
        session = await engine.open_session()
        result = await session.generate(prompt, GenerationConfig(max_new_tokens=4, ignore_eos=True))
        assert len(result.token_ids) == 4 and all(0 <= t < 151936 for t in result.token_ids)
    finally:
        await engine.aclose()
