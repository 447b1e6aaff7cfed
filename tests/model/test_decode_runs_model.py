"""Runs of one-token steps on the default model (``PagedSlot.feed_run``, ``GenerationConfig.decode_run``):
greedy decoding with runs equals one token per feed — tokens, stream, finish, KV bytes — under
every plugin profile (the same compiled graph, its inputs written another way, on a request of its
own); the graph's own argmax (``next_token``) is numpy's on every step; a session that starts
decoding while another runs shares its steps from then on and both get their solo tokens; seeded
sampling draws the same tokens with runs on or off; a stream closed mid-run leaves the KV that one
token per feed leaves. The fake-model tests are in ``tests/test_decode_runs.py``."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.paged.engine import PagedEngine
from agentkv.engine.paged.model import BLOCK_SIZE, SequenceStep
from _numerics import PROFILES, skip_if_computed_as_before, skip_if_ignored

pytestmark = pytest.mark.model

RUNS, ONE_BY_ONE = GenerationConfig(max_new_tokens=48, prompt_lookup=False), \
    GenerationConfig(max_new_tokens=48, prompt_lookup=False, decode_run=1)


@pytest.fixture(scope="module", params=list(PROFILES))
async def profile_engine(request: pytest.FixtureRequest):
    """A paged engine with the profile's plugin settings; skipped when this CPU ignores them or
    computes them as a profile already run."""
    await skip_if_computed_as_before(request.param, __name__)
    engine = PagedEngine(num_slots=2, prefix_cache_bytes=0, kv_cache_bytes=32 << 20,
                         ov_config=dict(PROFILES[request.param]))
    try:
        skip_if_ignored(request.param, engine)
        yield engine
    finally:
        await engine.aclose()


def chat(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                                        add_generation_prompt=True))


async def decode(engine, ids: list[int], config: GenerationConfig):
    """One call on a fresh session: the result, the streamed ids and text, the KV log and its snapshot."""
    session = await engine.open_session()
    try:
        stream = session.stream(ids, config)
        deltas = [delta async for delta in stream]
        assert stream.result is not None
        return stream.result, [d.token_id for d in deltas], "".join(d.text for d in deltas), session.tokens, \
            await session.snapshot()
    finally:
        await session.close()


async def test_greedy_runs_equal_one_token_per_feed_bit_for_bit_under_every_profile(profile_engine):
    ids = chat(profile_engine, "Explain how a refrigerator keeps food cold, step by step.")
    runs, run_ids, run_text, run_log, run_kv = await decode(profile_engine, ids, RUNS)
    plain, plain_ids, plain_text, plain_log, plain_kv = await decode(profile_engine, ids, ONE_BY_ONE)
    assert runs.token_ids == plain.token_ids and runs.finish_reason == plain.finish_reason
    assert run_ids == plain_ids and run_text == plain_text == plain.text
    assert run_log == plain_log
    assert np.array_equal(run_kv.keys, plain_kv.keys) and np.array_equal(run_kv.values, plain_kv.values)
    assert runs.metrics.model_steps == plain.metrics.model_steps  # a run saves Python, not steps
    assert len(runs.token_ids) > 2 * GenerationConfig().decode_run  # several runs, not one


async def test_the_graphs_own_argmax_is_numpys_on_every_step_under_every_profile(profile_engine):
    model, pool = profile_engine.paged_model, profile_engine.block_pool
    ids = chat(profile_engine, "Write a short poem about rivers.")
    steps = 64
    holder = object()
    blocks = pool.allocate(-(-(len(ids) + steps) // BLOCK_SIZE), holder=holder)
    try:
        token = int(np.argmax(model.step([SequenceStep(ids, 0, blocks)])[-1]))
        for past_len in range(len(ids), len(ids) + steps):
            greedy, row = model.step_alone(token, past_len, blocks)
            assert greedy == int(np.argmax(row)), past_len
            token = greedy
    finally:
        pool.release(blocks)
        pool.unreserve(holder)


async def test_a_session_joining_a_run_shares_its_steps_and_both_get_their_solo_tokens(paged_exact):
    first, second = chat(paged_exact, "List five uses of copper."), chat(paged_exact, "Name three planets.")
    config = RUNS.model_copy(update={"max_new_tokens": 32, "ignore_eos": True})  # 4 runs of 8
    solo_first, *_ = await decode(paged_exact, first, config)
    solo_second, *_ = await decode(paged_exact, second, config)
    results: dict[str, object] = {}
    started = anyio.Event()

    async def one(name: str, ids: list[int], wait: bool) -> None:
        if wait:
            await started.wait()
        session = await paged_exact.open_session()
        try:
            stream = session.stream(ids, config)
            async for _ in stream:
                started.set()
            results[name] = stream.result
        finally:
            await session.close()

    before = paged_exact.batcher.stats()
    async with anyio.create_task_group() as tg:
        tg.start_soon(one, "first", first, False)
        tg.start_soon(one, "second", second, True)
    assert results["first"].token_ids == solo_first.token_ids  # type: ignore[attr-defined]
    assert results["second"].token_ids == solo_second.token_ids  # type: ignore[attr-defined]
    after = paged_exact.batcher.stats()
    assert after.largest_batch >= 2 and after.sequences - before.sequences > after.steps - before.steps


async def test_seeded_sampling_draws_the_same_tokens_with_runs_on_or_off(paged_exact):
    ids = chat(paged_exact, "Tell me a story about a lighthouse keeper.")
    for seed in (1, 2):
        sampled = {"temperature": 0.8, "top_p": 0.95, "seed": seed, "max_new_tokens": 24}  # 3 runs of 8
        on, _, _, on_log, _ = await decode(paged_exact, ids, RUNS.model_copy(update=sampled))
        off, _, _, off_log, _ = await decode(paged_exact, ids, ONE_BY_ONE.model_copy(update=sampled))
        assert on.token_ids == off.token_ids and on_log == off_log, (on.text, off.text)


@pytest.mark.parametrize("received", [1, 5, 11])
async def test_a_stream_closed_mid_run_leaves_the_kv_one_token_per_feed_leaves(paged_exact, received):
    ids = chat(paged_exact, "Describe the water cycle.")
    logs = []
    for config in (RUNS, ONE_BY_ONE):
        session = await paged_exact.open_session()
        try:
            stream = session.stream(ids, config.model_copy(update={"ignore_eos": True}))
            got = 0
            async for _ in stream:
                got += 1
                if got == received:
                    break
            await stream.aclose()
            logs.append(session.tokens)
        finally:
            await session.close()
    assert logs[0] == logs[1] and len(logs[0]) == len(ids) + received - 1
