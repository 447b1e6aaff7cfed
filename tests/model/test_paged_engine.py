"""PagedEngine behind the same session protocol: conversations, restores, offload, span drops
and block accounting on the paged form of the default model (its default numerics)."""

from __future__ import annotations

import numpy as np
import pytest
from zoo_helpers import ZOO

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.engine.paged.block_pool import KVPoolExhausted

pytestmark = pytest.mark.model

CFG = GenerationConfig(max_new_tokens=12)
TINY = ZOO / "llama3_1"
"""A tiny random-weight model (tests/data/zoo), for a test of how engines hand on their graphs."""


@pytest.fixture
async def paged():
    """A paged engine on one slot, new for each test and closed after it: a closed engine hands its
    compiled graphs to the next one on the same settings (``AGENTKV_KEEP_COMPILED``, set by
    tests/conftest.py), so these engines and the small-pool ones below share one compile of the
    default model, where a module-wide engine kept its graphs and the small pool compiled its own
    (~15 s of CPU)."""
    from agentkv.engine.paged.engine import PagedEngine

    engine = PagedEngine(num_slots=1, kv_cache_bytes=64 << 20)
    try:
        yield engine
        engine.block_pool.check_integrity()
    finally:
        await engine.aclose()


async def test_a_conversation_on_the_paged_engine_prefills_only_each_new_turn(paged):
    agent = Agent(name="paged-chat", instructions="You are brief.", generation=CFG)
    runtime = Runtime(paged)
    session = await runtime.open_conversation(agent)
    try:
        await runtime.run(session, "What is the capital of France?")  # reads the system prompt too
        for question in ("And of Italy?", "Which one is older?"):
            result = await runtime.run(session, question)
            metrics = result.call_metrics[-1]
            new_turn = len(paged.tokenizer.encode(question))
            assert metrics.prefilled_tokens <= new_turn + 12 and metrics.kv_exact
        assert metrics.reused_tokens > 40
    finally:
        await runtime.aclose()


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True))


async def test_offloaded_and_restored_paged_sessions_answer_like_the_uninterrupted_one(paged):
    """Two conversations, each through the three paths (never moved, offloaded by the one slot,
    restored from a snapshot): a second prompt shows the agreement is not one prompt's luck."""
    follow = paged.tokenizer.encode("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    for topic in ("bees", "glass"):
        first = prompt(paged, f"Tell me one fact about {topic}.")
        steady = await paged.open_session()
        one = await steady.generate(first, CFG)
        snapshot = await steady.snapshot()
        second = list(steady.tokens) + list(one.token_ids[-1:]) + follow
        expected = (await steady.generate(second, CFG)).token_ids
        await steady.close()

        moved = await paged.open_session()
        await moved.generate(first, CFG)
        intruder = await paged.open_session()
        await intruder.prefill([1, 2, 3])  # the only slot: `moved` goes to host memory
        await intruder.close()
        offloaded = await moved.generate(second, CFG)
        await moved.close()

        restored = await paged.open_session()
        await restored.restore(snapshot)
        again = await restored.generate(second, CFG)
        await restored.close()
        assert offloaded.token_ids == expected == again.token_ids, topic
        assert offloaded.metrics.kv_exact and again.metrics.restored_tokens == snapshot.num_tokens
    cached = paged.prefix_cache.stats().bytes // paged.paged_model.block_bytes  # blocks of shared prefixes
    assert paged.block_pool.free_blocks + cached == paged.block_pool.num_blocks  # every other block came back


async def test_span_drops_work_on_the_paged_engine_with_the_models_rope(paged):
    convention = await paged.rope_convention()
    assert convention is not None and convention.theta == pytest.approx(100000.0, rel=1e-3)
    session = await paged.open_session()
    try:
        ids = paged.tokenizer.encode("The river keeps flowing to the sea while the fox jumps. " * 6)
        await session.prefill(ids)
        await session.drop(8, 40)
        assert session.tokens == tuple(ids[:8] + ids[40:]) and session.shifted
        assert np.isfinite(await session.next_token_logits()).all()
    finally:
        await session.close()


async def test_beam_search_on_paged_blocks_finds_the_beams_the_stateful_engine_finds(paged_exact, engine_f32):
    config = GenerationConfig(max_new_tokens=12, num_beams=3, num_return_sequences=3)
    ids = prompt(paged_exact, "Name three rivers.")
    results = []
    for engine in (engine_f32, paged_exact):
        session = await engine.open_session()
        results.append(await session.generate(ids, config))
        kept = tuple(ids) + results[-1].token_ids
        assert session.tokens == (kept[:-1] if kept[-1] in engine.eos_token_ids else kept)
        await session.check_integrity()
        await session.close()
    stateful, paged = results
    assert [b.token_ids for b in paged.beams] == [b.token_ids for b in stateful.beams]
    assert [b.score for b in paged.beams] == pytest.approx([b.score for b in stateful.beams], abs=1e-3)
    paged_exact.block_pool.check_integrity()
    assert paged_exact.block_pool.free_blocks == paged_exact.block_pool.num_blocks  # no prefix cache here


async def test_a_cancelled_paged_beam_search_leaves_the_session_at_its_prompt(paged):
    import anyio

    session = await paged.open_session()
    ids = prompt(paged, "Write a long poem about the sea.")
    try:
        with anyio.move_on_after(0.3):
            await session.generate(ids, GenerationConfig(max_new_tokens=200, num_beams=4, ignore_eos=True))
        assert session.tokens == tuple(ids)
        await session.check_integrity()
        result = await session.generate(ids, CFG)  # the session goes on from its prompt
        assert result.metrics.reused_tokens == len(ids) - 1 or result.metrics.reused_tokens == len(ids)
    finally:
        await session.close()
    paged.block_pool.check_integrity()


async def test_a_paged_fork_shares_the_parents_blocks_and_each_writes_only_its_own_copies(paged_engine):
    tok = paged_engine.tokenizer
    prompt = tok.encode("<|im_start|>user\n" + "Tell me about rivers and the sea. " * 8 + "<|im_end|>\n"
                        "<|im_start|>assistant\n")
    follow = tok.encode("Rivers")
    config = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    parent = await paged_engine.open_session()
    await parent.prefill(prompt)
    before = await parent.snapshot()
    free = paged_engine.block_pool.free_blocks
    child = await parent.fork()
    assert paged_engine.block_pool.free_blocks == free  # the fork copied no KV
    assert (await child.snapshot()).tokens == before.tokens  # read through the shared blocks
    from_child = await child.generate(prompt + follow, config)
    after = await parent.snapshot()
    assert np.array_equal(after.keys, before.keys) and np.array_equal(after.values, before.values)
    from_parent = await parent.generate(prompt + follow, config)
    assert from_child.token_ids == from_parent.token_ids  # the same computation on the same blocks
    assert from_child.metrics.reused_tokens == from_parent.metrics.reused_tokens == len(prompt)
    for session in (parent, child):
        await session.check_integrity()
        await session.close()
    paged_engine.block_pool.check_integrity()


@pytest.fixture
async def small_pool(paged):
    """A paged engine with 20 KV blocks (640 tokens), 4 slots and no prefix cache. ``paged`` is closed
    first, so this engine takes its compiled graphs instead of compiling (~15 s of CPU); the test
    closes it (closing again here is a no-op)."""
    from agentkv.engine.paged.engine import PagedEngine

    block = paged.paged_model.block_bytes
    await paged.aclose()
    engine = PagedEngine(num_slots=4, kv_cache_bytes=20 * block, prefix_cache_bytes=0)
    try:
        yield engine
    finally:
        await engine.aclose()


async def test_when_blocks_run_short_a_fork_that_has_not_run_moves_to_host_and_answers_as_before(small_pool):
    engine = small_pool  # 20 blocks: 640 tokens
    text = "The river keeps flowing to the sea while the fox jumps. " * 16
    ids = prompt(engine, text)  # ~210 tokens: 7 blocks
    follow = engine.tokenizer.encode("Rivers")
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    try:
        parent = await engine.open_session()
        await parent.prefill(ids)
        reference = await parent.fork()
        expected = await reference.generate(ids + follow, config)
        await reference.close()
        child = await parent.fork()  # holds the parent's blocks, no slot
        await parent.close()  # the child's references alone keep those blocks now
        used = engine.block_pool.num_blocks - engine.block_pool.free_blocks
        assert used == -(-len(ids) // 32)
        other = await engine.open_session()
        other_ids = prompt(engine, "Another story about the fox and the sea. " * 45)
        # it fits in the pool only without the child's blocks
        assert engine.block_pool.free_blocks < -(-len(other_ids) // 32) <= engine.block_pool.num_blocks
        await other.prefill(other_ids)
        # the child's KV went to host: the pool holds the other session's blocks alone
        assert engine.block_pool.num_blocks - engine.block_pool.free_blocks == -(-len(other_ids) // 32)
        await other.close()
        again = await child.generate(ids + follow, config)
        assert again.token_ids == expected.token_ids and again.metrics.kv_exact
        assert again.metrics.reused_tokens == len(ids)
        await child.check_integrity()
        await child.close()
    finally:
        await engine.aclose()
    engine.block_pool.check_integrity()
    assert engine.block_pool.free_blocks == engine.block_pool.num_blocks


async def test_when_blocks_run_short_idle_sessions_go_to_host_and_come_back_exactly(small_pool):
    engine = small_pool  # 20 blocks: 640 tokens
    tok = engine.tokenizer
    texts = [f"Session {i}: " + "The river keeps flowing to the sea while the fox jumps. " * 20 for i in range(3)]
    prompts = [prompt(engine, text) for text in texts]  # ~260 tokens each (9 blocks): three do not fit at once
    follow = tok.encode("<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n")
    try:
        sessions = [await engine.open_session() for _ in prompts]
        first = [await s.generate(p, CFG) for s, p in zip(sessions, prompts)]  # the third evicts the first
        assert engine.pool.offloads >= 1
        again = await sessions[0].generate([*sessions[0].tokens, first[0].token_ids[-1], *follow], CFG)
        assert again.metrics.restored_tokens > 0 and again.metrics.kv_exact
        reference = await engine.open_session()  # the same turns, never moved
        await sessions[1].close()
        await sessions[2].close()
        await reference.generate(prompts[0], CFG)
        expected = await reference.generate([*reference.tokens, first[0].token_ids[-1], *follow], CFG)
        assert again.token_ids == expected.token_ids
        for session in (sessions[0], reference):
            await session.check_integrity()
            await session.close()
        with pytest.raises(KVPoolExhausted, match="kv_cache_bytes"):  # alone bigger than the pool
            huge = await engine.open_session()
            await huge.prefill(prompt(engine, "word " * 700))
        await huge.close()
    finally:
        await engine.aclose()
    engine.block_pool.check_integrity()
    assert engine.block_pool.free_blocks == engine.block_pool.num_blocks


async def test_counters_move_with_a_generate_on_both_engines(paged, engine_f32):
    for engine, slots_or_blocks in ((paged, paged.block_pool.num_blocks), (engine_f32, 3)):
        before = engine.counters()
        assert before.kv_blocks_total == slots_or_blocks
        session = await engine.open_session()
        try:
            await session.generate(prompt(engine, "Name a colour."), CFG)
            during = engine.counters()
            async with engine.backend.pool.lease(session):  # a call running on its KV
                running = engine.counters()
        finally:
            await session.close()
        assert 0 < during.kv_blocks_used <= during.kv_blocks_total
        # idle, its KV is kept but evictable (to host on demand): not in use, as vLLM counts it
        assert during.kv_blocks_active == 0 and during.kv_blocks_evictable == during.kv_blocks_used
        assert running.kv_blocks_active == running.kv_blocks_used - running.kv_blocks_evictable > 0
        assert during.model_steps > before.model_steps
    tok = paged.tokenizer
    system = tok.encode("<|im_start|>system\n" + "You answer in one word only. " * 6 + "<|im_end|>\n")
    paged.register_prefix(system)
    hits = paged.counters().prefix_cache_hit_tokens
    for question in ("Sky?", "Grass?"):  # the second reads the first one's cached prefix
        session = await paged.open_session()
        await session.prefill(system + tok.encode(f"<|im_start|>user\n{question}<|im_end|>\n"))
        await session.close()
    assert paged.counters().prefix_cache_hit_tokens == hits + len(system)


async def test_a_closed_paged_engine_hands_its_graphs_to_the_next_one_and_refuses_to_step(
        monkeypatch, private_compiled_pool):
    """``aclose`` releases the paged model: its sessions are closed, a session opened after it gets
    a clear error when it steps, and with ``AGENTKV_KEEP_COMPILED`` the next engine on the same
    settings opens without compiling and answers what the first one answered. On a tiny zoo model:
    the mechanics, not the numbers, are tested, and its graphs compile in ~1 s (the default's ~7 s)."""
    from agentkv.engine.paged.compiled_pool import KEEP_ENV
    from agentkv.engine.paged.engine import PagedEngine
    from agentkv.errors import UserError

    pool, compiles = private_compiled_pool
    monkeypatch.setenv(KEEP_ENV, "3")
    config = GenerationConfig(max_new_tokens=6, ignore_eos=True)
    answers = []
    for _ in range(2):
        engine = PagedEngine(TINY, num_slots=1, kv_cache_bytes=16 << 20)
        prompt = list(engine.tokenizer.encode("The capital of France is"))
        session = await engine.open_session()
        answers.append((await session.generate(prompt, config)).token_ids)
        late = await engine.open_session()
        await engine.aclose()
        assert engine.paged_model.graphs == 0 and pool.idle_graphs() == 3
        with pytest.raises(UserError, match="is closed"):
            await late.prefill(prompt)
        with pytest.raises(UserError, match="released"):
            await (await engine.open_session()).prefill(prompt)
    assert len(compiles) == 3 and answers[0] == answers[1]
