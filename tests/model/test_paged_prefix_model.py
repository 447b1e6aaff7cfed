"""Prefix hits, forks and beam rows as shared blocks on the paged engine: block accounting and
copy-on-write under any sequence of operations (hypothesis, over a fake paged model that checks every write), and
on the real model a hit that copies nothing and computes exactly what a cold prefill computes.

The tests here run the real model; the scripted ones are in ``tests/test_paged_prefix.py``."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.engine.paged.model import BLOCK_SIZE
from agentkv.engine.paged.block_table import blocks_for

pytestmark = pytest.mark.model


# ---- the real model ---------------------------------------------------------------------------
async def test_a_prefix_hit_points_at_cached_blocks_and_computes_exactly_what_a_cold_prefill_does():
    from agentkv.engine.base import GenerationConfig
    from agentkv.engine.paged.engine import PagedEngine

    engine = PagedEngine(num_slots=3, kv_cache_bytes=32 << 20)
    tok = engine.tokenizer
    system = tok.encode("<|im_start|>system\nYou are a careful assistant. " + "Answer briefly and cite facts. " * 12
                        + "<|im_end|>\n")
    engine.register_prefix(system)
    question = tok.encode("<|im_start|>user\nWhat is a lighthouse?<|im_end|>\n<|im_start|>assistant\n")
    try:
        cold = await engine.open_session()
        await cold.prefill(system + question)  # computes the prefix, and the cache shares its blocks
        assert engine.prefix_cache.stats().nodes == 1
        free_before = engine.block_pool.free_blocks
        warm = await engine.open_session()
        metrics = await warm.prefill(system + question)
        used = free_before - engine.block_pool.free_blocks
        assert metrics.prefix_cache_tokens == len(system) and metrics.prefilled_tokens == len(question)
        # the prefix's full blocks are shared: only the rest, and a copy of the partial block, are new
        assert used <= blocks_for(len(system) + len(question)) - len(system) // BLOCK_SIZE + 1
        assert np.array_equal(await warm.next_token_logits(), await cold.next_token_logits())
        hit = engine.prefix_cache.lookup([*system, 1])
        assert hit is not None
        cached = np.array(engine.paged_model.cache_layers()[0][0][list(hit.blocks)])
        hit.release()
        config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
        await warm.generate(system + question, config)  # writes after the prefix, in its own copies
        await cold.generate(system + question, config)
        assert np.array_equal(cached, engine.paged_model.cache_layers()[0][0][list(hit.blocks)])
        for session in (cold, warm):
            await session.close()
    finally:
        await engine.aclose()
    engine.prefix_cache.clear()
    engine.block_pool.check_integrity()
    assert engine.block_pool.free_blocks == engine.block_pool.num_blocks
