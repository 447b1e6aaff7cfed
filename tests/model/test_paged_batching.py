"""Continuous batching on the paged engine: sessions decoding at the same time share model
steps, each with its own sampling, stop and stream; one cancelled leaves the rest running.

Exactness (measured on the default model): with ``exact=True`` a sequence stepped in a batch
gets the very logits it gets alone, so every answer — greedy or seeded sampling — equals the
one decoded alone, and that is asserted. With this CPU's default numerics (bf16 compute
and dynamic quantisation on avx512 machines) a batched step differs from a solo one by up to
~0.6 max abs logit, so greedy answers may part after a few dozen tokens; there only the
mechanics are asserted.
"""

from __future__ import annotations

import anyio
import pytest

from agentkv.engine.base import GenerationConfig

pytestmark = pytest.mark.model

CONFIGS = [
    GenerationConfig(max_new_tokens=24, ignore_eos=True),
    GenerationConfig(max_new_tokens=24, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True),
    GenerationConfig(max_new_tokens=24, repetition_penalty=1.3, ignore_eos=True),
    GenerationConfig(max_new_tokens=24, stop_strings=(".",), ignore_eos=True),
]


def prompts(engine) -> list[list[int]]:
    topics = ("a lighthouse", "the moon", "bread", "a violin")
    return [engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Write two sentences about {topic}."}], add_generation_prompt=True))
        for topic in topics]


async def answer_together(engine, ids: list[list[int]]):
    sessions = [await engine.open_session() for _ in ids]
    results: list = [None] * len(ids)

    async def answer(i: int) -> None:
        results[i] = await sessions[i].generate(ids[i], CONFIGS[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(ids)):
            tg.start_soon(answer, i)
    for prompt, session, result in zip(ids, sessions, results):
        await session.check_integrity()
        assert session.tokens[: len(prompt)] == tuple(prompt)
        assert session.tokens[len(prompt):] == result.token_ids[: len(session.tokens) - len(prompt)]
        await session.close()
    return results


async def test_sessions_decoding_together_share_steps_and_answer_exactly_as_alone(paged_exact):
    ids = prompts(paged_exact)
    alone = []
    for i, prompt in enumerate(ids):
        session = await paged_exact.open_session()
        alone.append(await session.generate(prompt, CONFIGS[i]))
        await session.close()
    before = paged_exact.batcher.stats()
    together = await answer_together(paged_exact, ids)
    after = paged_exact.batcher.stats()
    assert after.largest_batch > 1
    assert (after.sequences - before.sequences) > (after.steps - before.steps)  # fewer steps than feeds
    for one, many in zip(alone, together):
        assert many.token_ids == one.token_ids and many.text == one.text
    stopped = together[3]  # its stop string ended it (the text stops before it), the others ran on
    assert stopped.finish_reason == "stop" and "." not in stopped.text and len(stopped.token_ids) < 24


async def test_cancelling_one_batched_session_leaves_the_others_running(paged_exact):
    ids = prompts(paged_exact)
    sessions = [await paged_exact.open_session() for _ in ids]
    results: dict[int, object] = {}
    config = GenerationConfig(max_new_tokens=20, ignore_eos=True)

    async def answer(i: int) -> None:
        results[i] = await sessions[i].generate(ids[i], config)

    async def answer_then_give_up() -> None:
        with anyio.CancelScope() as scope:
            async for delta in sessions[0].stream(ids[0], config):
                if len(sessions[0].tokens) > len(ids[0]) + 3:
                    scope.cancel()
        results[0] = "cancelled"

    async with anyio.create_task_group() as tg:
        tg.start_soon(answer_then_give_up)
        for i in range(1, len(ids)):
            tg.start_soon(answer, i)
    assert results[0] == "cancelled" and len(sessions[0].tokens) < len(ids[0]) + 19
    for i in range(1, len(ids)):
        assert len(results[i].token_ids) == 20  # type: ignore[attr-defined]
    for session in sessions:
        await session.check_integrity()
        await session.close()


async def test_on_default_numerics_batched_sessions_keep_their_logs_and_blocks_consistent():
    from agentkv.engine.paged.engine import PagedEngine

    engine = PagedEngine(num_slots=len(CONFIGS), kv_cache_bytes=32 << 20)
    try:
        results = await answer_together(engine, prompts(engine))
        assert all(r.token_ids for r in results)
        assert engine.batcher.stats().largest_batch > 1
    finally:
        await engine.aclose()
    engine.block_pool.check_integrity()
    assert engine.block_pool.free_blocks == engine.block_pool.num_blocks


async def test_a_long_prefill_runs_in_chunks_and_a_decoding_session_steps_between_them(paged_engine):
    engine = paged_engine
    chunk = engine.backend.prefill_chunk_size
    assert chunk == 1024
    long_text = " ".join(f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(110))
    long_ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": long_text}], add_generation_prompt=True))
    assert len(long_ids) > 1100
    decoder, reader = await engine.open_session(), await engine.open_session()
    # the record keeps the last RECENT_STEPS steps only: note which ones came before by identity
    earlier = engine.batcher.recent_steps()  # kept alive, so no new record can reuse an id
    before = {id(s) for s in earlier}
    first_token = anyio.Event()
    results: dict = {}

    async def decode() -> None:
        # NOTE: one step per token (no drafts): the test counts the decoder's steps
        stream = decoder.stream(prompts(engine)[0], GenerationConfig(max_new_tokens=48, ignore_eos=True,
                                                                     prompt_lookup=False))
        async for _ in stream:
            first_token.set()
        results["decoder"] = stream.result

    async def read() -> None:
        await first_token.wait()
        results["reader"] = await reader.prefill(long_ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(decode)
        tg.start_soon(read)
    steps = [s for s in engine.batcher.recent_steps() if id(s) not in before]
    reader_metrics = results["reader"]
    fed = reader_metrics.prefilled_tokens  # a registered prefix may come from the prefix cache
    assert fed + reader_metrics.prefix_cache_tokens == len(long_ids) and fed > 1024
    assert reader_metrics.model_steps >= -(-fed // chunk) >= 2
    # no step carried more than one chunk (plus decoders' single tokens)
    assert max(s.tokens for s in steps) <= chunk + engine.batcher.max_batch
    # the decoder's tokens ran in steps with the reader's chunks, not after the whole prompt
    assert reader_metrics.mean_batch > 1.0
    decoder_metrics = results["decoder"].metrics
    assert decoder_metrics.model_steps >= 48 and decoder_metrics.mean_batch > 1.0
    assert decoder_metrics.queued_s >= 0.0
    await decoder.close()
    await reader.close()
