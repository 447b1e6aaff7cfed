"""Live paged engines on the same model and settings share one compiled set of graphs
(``compiled_pool.CompiledPool.share``): a second engine compiles nothing, both decode what a lone
engine decodes (also stepping at the same time, each on its own infer requests and KV blocks),
closing one leaves the other decoding, and closing both frees the set (kept idle when
``AGENTKV_KEEP_COMPILED`` allows). On the zoo's tiny Llama 3.1: its graphs compile in ~1 s."""

from __future__ import annotations

import threading

import anyio
import numpy as np
import pytest
from test_paged_model import TINY, TINY_IDS, tiny_files

from agentkv import GenerationConfig

pytestmark = pytest.mark.model

CONFIG = GenerationConfig(max_new_tokens=12, ignore_eos=True, prompt_lookup=False)
PROMPTS = ("The capital of France is", "Once upon a time, in a small village,", "def fibonacci(n):")


def open_tiny_engine(**options):
    from agentkv.engine.paged.engine import PagedEngine

    return PagedEngine(TINY, **{"num_slots": 2, "kv_cache_bytes": 16 << 20, **options})


async def answer(engine, text: str) -> list[int]:
    """Greedy tokens for ``text`` on a fresh session of ``engine``."""
    session = await engine.open_session()
    try:
        return list((await session.generate(list(engine.tokenizer.encode(text)), CONFIG)).token_ids)
    finally:
        await session.close()


async def answers_at_once(*engines) -> list[list[list[int]]]:
    """Every prompt on every engine, all started together: per engine, its answers in prompt order."""
    got: list[list[list[int]]] = [[[] for _ in PROMPTS] for _ in engines]

    async def one(e: int, p: int) -> None:
        got[e][p] = await answer(engines[e], PROMPTS[p])

    async with anyio.create_task_group() as group:
        for e in range(len(engines)):
            for p in range(len(PROMPTS)):
                group.start_soon(one, e, p)
    return got


async def test_a_second_engine_opened_while_the_first_is_live_compiles_nothing_and_both_decode_as_a_lone_engine(
        monkeypatch, private_compiled_pool):
    from agentkv.engine.paged.compiled_pool import KEEP_ENV

    pool, compiles = private_compiled_pool
    monkeypatch.setenv(KEEP_ENV, "0")
    first = open_tiny_engine()
    try:
        alone = [await answer(first, text) for text in PROMPTS]
        assert first.paged_model.wait_for_graphs() == len(compiles) == 3
        second = open_tiny_engine(num_slots=3, kv_cache_bytes=8 << 20)  # other slots and blocks: the same graphs
        try:
            assert len(compiles) == 3 and second.paged_model.graphs == 3
            key = first.paged_model.graph_key
            assert second.paged_model.graph_key == key and pool.users(key) == 2
            assert second.paged_model.caches["key_cache.0"] is not first.paged_model.caches["key_cache.0"]
            assert await answers_at_once(first, second) == [alone, alone]
        finally:
            await second.aclose()
    finally:
        await first.aclose()


async def test_closing_one_engine_leaves_the_other_decoding_and_closing_both_frees_the_set(
        monkeypatch, private_compiled_pool):
    from agentkv.engine.paged.compiled_pool import KEEP_ENV

    pool, compiles = private_compiled_pool
    monkeypatch.setenv(KEEP_ENV, "3")
    first, second = open_tiny_engine(), open_tiny_engine()
    key = first.paged_model.graph_key
    try:
        alone = [await answer(second, text) for text in PROMPTS]
        await first.aclose()
        assert first.paged_model.graphs == 0 and pool.users(key) == 1 and pool.idle_graphs() == 0
        assert [await answer(second, text) for text in PROMPTS] == alone
    finally:
        await second.aclose()
    assert pool.users(key) == 0 and pool.idle_graphs() == 3  # the whole set, idle for the next engine
    third = open_tiny_engine()
    try:
        assert len(compiles) == 3 and pool.idle_graphs() == 0 and pool.users(key) == 1
        assert [await answer(third, text) for text in PROMPTS] == alone
    finally:
        monkeypatch.setenv(KEEP_ENV, "0")
        await third.aclose()
    assert pool.users(key) == 0 and pool.idle_graphs() == 0  # nothing kept: the set went with its last engine


def test_models_opened_at_once_on_one_key_compile_one_set_and_step_alike(private_compiled_pool):
    """The second model waits for the first one's compile instead of compiling its own."""
    from agentkv.engine.paged.model import PagedModel, SequenceStep

    pool, compiles = private_compiled_pool
    models: list[PagedModel] = []
    start = threading.Barrier(2)

    def open_model() -> None:
        start.wait()
        models.append(PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=True))

    threads = [threading.Thread(target=open_model) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert len(models) == 2 and [m.wait_for_graphs() for m in models] == [3, 3] and len(compiles) == 3
    assert pool.users(models[0].graph_key) == 2
    prefill, decode = [SequenceStep(TINY_IDS[:40], 0, [0, 1])], [SequenceStep(TINY_IDS[40:41], 40, [0, 1])]
    first, second = models
    assert all(np.array_equal(first.step(step), second.step(step)) for step in (prefill, decode))
    other = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=False)
    assert len(compiles) == 4 and pool.users(other.graph_key) == 1  # other settings: a set of its own
    for model in (*models, other):
        model.release()
    assert pool.users(models[0].graph_key) == 0
