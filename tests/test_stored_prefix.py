"""A new session takes its prompt's leading full blocks from the KV store instead of prefilling them:
the blocks another session's offload (or a runtime's turn-end save) wrote, keyed as a cold prefill
of the prompt computes them — the prefix hit, the resume and the offload are one lookup. Fake
slots (``testing/fake_kv.py``) hold KV that names its tokens and positions, so a wrong block would
fail the session's next step."""

from __future__ import annotations

import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.testing import ScriptedEngine

SHARED = list(range(2000, 2100))  # 100 tokens: three full blocks another session computed
ONE = GenerationConfig(max_new_tokens=1)


async def kv_of(engine: ScriptedEngine, session) -> np.ndarray:
    return (await session.snapshot()).to_float()[0]


async def test_a_new_session_takes_the_full_blocks_another_session_offloaded_and_prefills_the_rest() -> None:
    engine = ScriptedEngine(replies=["a", "b", "c"], num_slots=1, prefix_cache_bytes=1 << 20)
    first = await engine.open_session()
    await first.generate(SHARED + [7, 8], ONE)
    second = await engine.open_session()  # the one slot: the first session is offloaded into the store
    result = await second.generate(SHARED + [9, 10, 11], ONE)
    m = result.metrics
    assert m.prefix_cache_tokens == 96 and m.prefilled_tokens == m.prompt_tokens - 96
    assert engine.backend.pool.host.stats().prefix_tokens == 96
    cold = await engine.open_session()
    await cold.generate(SHARED + [9, 10, 11], ONE)  # the second session is offloaded in turn
    assert np.array_equal(await kv_of(engine, second), await kv_of(engine, cold))  # the same KV as a cold prefill
    await second.check_integrity()


async def test_tenants_never_take_each_others_blocks_and_the_prefix_cache_setting_turns_it_off() -> None:
    engine = ScriptedEngine(replies=["a", "b"], num_slots=1, prefix_cache_bytes=1 << 20)
    first = await engine.open_session(salt="team-a")
    await first.generate(SHARED + [7], ONE)
    other = await engine.open_session(salt="team-b")
    assert (await other.generate(SHARED + [9], ONE)).metrics.prefix_cache_tokens == 0
    off = ScriptedEngine(replies=["a", "b"], num_slots=1)  # prefix_cache_bytes=0: no prefix reuse at all
    a = await off.open_session()
    await a.generate(SHARED + [7], ONE)
    b = await off.open_session()
    assert (await b.generate(SHARED + [9], ONE)).metrics.prefix_cache_tokens == 0


async def test_a_session_that_holds_more_than_the_store_keeps_its_own_kv() -> None:
    engine = ScriptedEngine(replies=["a", "b", "c"], num_slots=1, prefix_cache_bytes=1 << 20)
    first = await engine.open_session()
    await first.generate(SHARED[:64] + [7], ONE)
    second = await engine.open_session()  # the first is offloaded: its two blocks are stored
    one = await second.generate(SHARED + [9], ONE)
    assert one.metrics.prefix_cache_tokens == 64
    two = await second.generate([*second.tokens, 5, 6], ONE)  # it holds 101 tokens; the store 64
    assert two.metrics.prefix_cache_tokens == 0 and two.metrics.reused_tokens == len(SHARED) + 1
