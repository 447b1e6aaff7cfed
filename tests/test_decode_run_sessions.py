"""End-to-end tests of decode runs (issue 27) over the fake bigram paged model: a session decodes the
same tokens with runs on or off (greedy, seeded sampled, prompt-lookup drafts between runs) and its
KV equals its tokens; a stream closed mid-run leaves one-by-one decoding's log; sessions decoding
together, with or without a step batcher, get their solo tokens; a call whose choice needs more than
the logits never runs; ``decode_run`` is bounded. The loop itself is tested in ``test_decode_runs.py``,
the pieces in ``test_decode_run_pieces.py``."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio
import anyio.to_thread
import numpy as np
import pydantic
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.session import SlotSession
from agentkv.testing import ScriptedTokenizer
from test_speculative_sampling import BigramPagedModel, assert_kv_is_tokens, bigram_table

from test_decode_runs import PROMPT, REPEATING


# ---- end to end: a paged session over the bigram model -------------------------------------------

class CountingBigramModel(BigramPagedModel):
    """The bigram paged model, counting one-token steps taken alone."""

    def __init__(self, pool: BlockPool, table: np.ndarray) -> None:
        super().__init__(pool, table)
        self.alone_steps = 0

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        self.alone_steps += 1
        return super().step_alone(token, past_len, blocks, while_running=while_running)


def run_backend(table: np.ndarray, *, batched: bool, slots: int = 1) -> tuple[PagedBackend, CountingBigramModel]:
    pool = BlockPool(16)
    model = CountingBigramModel(pool, table)
    batcher = StepBatcher(model.step) if batched else None
    backend = PagedBackend(model, pool, slots=[PagedSlot(model, pool, batcher) for _ in range(slots)],
                           tokenizer=ScriptedTokenizer(), fingerprint="bigram",
                           eos_token_ids={ScriptedTokenizer().eos_token_id}, max_context_len=4096,
                           kv_bytes_per_token=8)
    return backend, model


def run_session(table: np.ndarray, *, batched: bool) -> tuple[SlotSession, CountingBigramModel]:
    backend, model = run_backend(table, batched=batched)
    return SlotSession(backend), model


SESSION_CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=30, prompt_lookup=False),
    "sampled": GenerationConfig(max_new_tokens=30, temperature=0.8, top_p=0.95, prompt_lookup=False),
    "greedy-lookup": GenerationConfig(max_new_tokens=30),
    "sampled-lookup": GenerationConfig(max_new_tokens=30, temperature=0.8),
    "greedy-stop-id": GenerationConfig(max_new_tokens=30, prompt_lookup=False, stop_token_ids=frozenset({3})),
    "sampled-stop-id": GenerationConfig(max_new_tokens=30, temperature=0.8, prompt_lookup=False,
                                        stop_token_ids=frozenset({6})),
}


@pytest.mark.parametrize("batched", [False, True], ids=["no-batcher", "batcher"])
@pytest.mark.parametrize("name", list(SESSION_CONFIGS))
async def test_a_session_decodes_the_same_tokens_with_runs_and_its_kv_equals_its_tokens(
        name: str, batched: bool) -> None:
    base = SESSION_CONFIGS[name]
    prompt = REPEATING if base.prompt_lookup else PROMPT
    results: dict[int, list[tuple[int, ...]]] = {}
    logs: dict[int, list[list[int]]] = {}
    alone = drafted = 0
    for run in (1, 8):
        session, model = run_session(bigram_table(1), batched=batched)
        results[run], logs[run] = [], []
        for seed in range(6):
            config = base.model_copy(update={"decode_run": run, "seed": seed})
            result = await session.generate(prompt, config)
            results[run].append(result.token_ids)
            logs[run].append(list(session.tokens))
            await assert_kv_is_tokens(session)
            if run == 8:
                drafted += result.metrics.drafted_tokens
        if run == 8:
            alone = model.alone_steps
        else:
            assert model.alone_steps == 0
        await session.close()
    assert results[8] == results[1] and logs[8] == logs[1]
    assert alone > 0  # runs stepped alone
    if base.prompt_lookup:
        assert drafted > 0  # drafts and runs interleaved
    if base.stop_token_ids:
        assert any(tokens[-1] in base.stop_token_ids for tokens in results[8])


@pytest.mark.parametrize("k", [2, 4, 9])
@pytest.mark.parametrize("batched", [False, True], ids=["no-batcher", "batcher"])
async def test_closing_a_sessions_stream_mid_run_leaves_one_by_one_decodings_log_and_exact_kv(
        batched: bool, k: int) -> None:
    session, model = run_session(bigram_table(1), batched=batched)
    for seed in range(3):
        config = GenerationConfig(max_new_tokens=40, temperature=0.8, seed=seed, prompt_lookup=False)
        stream, taken = session.stream(PROMPT, config), []
        async for delta in stream:
            taken.append(delta.token_id)
            if len(taken) == k:
                await anyio.sleep(0.01)
                break
        await stream.aclose()
        assert list(session.tokens) == [*PROMPT, *taken[:-1]]
        await assert_kv_is_tokens(session)
    assert model.alone_steps > 0
    await session.close()


async def decode_together(backend: PagedBackend, prompts: list[list[int]], configs: list[GenerationConfig]
                          ) -> tuple[list[tuple[int, ...]], list[SlotSession]]:
    """One session per prompt on ``backend``, all generating at once: their tokens and the sessions."""
    sessions = [SlotSession(backend) for _ in prompts]
    together: list[tuple[int, ...]] = [() for _ in prompts]

    async def one(i: int) -> None:
        together[i] = (await sessions[i].generate(prompts[i], configs[i])).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return together, sessions


async def test_two_sessions_decoding_together_with_runs_get_their_one_by_one_tokens_and_exact_kv() -> None:
    prompts = [PROMPT, [2, 5, 1]]
    configs = [GenerationConfig(max_new_tokens=40, prompt_lookup=False, ignore_eos=True),
               GenerationConfig(max_new_tokens=40, temperature=0.8, seed=9, prompt_lookup=False, ignore_eos=True)]
    alone = []
    for prompt, config in zip(prompts, configs):
        session, _ = run_session(bigram_table(1), batched=True)
        alone.append((await session.generate(prompt, config.model_copy(update={"decode_run": 1}))).token_ids)
        await session.close()
    backend, _ = run_backend(bigram_table(1), batched=True, slots=2)
    together, sessions = await decode_together(backend, prompts, configs)
    assert together == alone
    for session in sessions:
        await assert_kv_is_tokens(session)
        await session.close()


NO_RUN_CONFIGS = {
    "presence-penalty": GenerationConfig(max_new_tokens=20, temperature=0.8, presence_penalty=0.5, prompt_lookup=False),
    "repetition-penalty": GenerationConfig(max_new_tokens=20, repetition_penalty=1.3, prompt_lookup=False),
    "logprobs": GenerationConfig(max_new_tokens=20, logprobs=2, prompt_lookup=False),
}


@pytest.mark.parametrize("name", list(NO_RUN_CONFIGS))
async def test_a_call_whose_choice_needs_more_than_the_logits_never_runs_and_decodes_the_same_tokens(name: str) -> None:
    got = {}
    for run in (1, 8):
        session, model = run_session(bigram_table(1), batched=False)
        config = NO_RUN_CONFIGS[name].model_copy(update={"decode_run": run, "seed": 5})
        got[run] = (await session.generate(PROMPT, config)).token_ids
        assert model.alone_steps == 0
        await assert_kv_is_tokens(session)
        await session.close()
    assert got[8] == got[1]


async def test_sessions_without_a_batcher_run_at_once_and_each_reads_its_own_logits() -> None:
    def shared_row(model: CountingBigramModel) -> None:
        """``step_alone`` as the real model's: the row is one array every slot shares, written
        under the lock and read after it (a thread switch right there, widened)."""
        row_of_all = np.zeros(model.table.shape[1], dtype=np.float32)
        plain = CountingBigramModel.step_alone.__get__(model)

        def step_alone(token: int, past_len: int, blocks: list[int], *,
                       while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
            with model.lock:
                top, row = plain(token, past_len, blocks, while_running=while_running)
                row_of_all[...] = row
            time.sleep(0.001)
            return top, row_of_all

        model.step_alone = step_alone  # type: ignore[method-assign]

    prompts = [[1, 2, 3], [2, 5, 1]]
    config = GenerationConfig(max_new_tokens=40, temperature=0.8, seed=4, ignore_eos=True, prompt_lookup=False)
    solo = []
    for prompt in prompts:
        backend, model = run_backend(bigram_table(1), batched=False)
        shared_row(model)
        solo.append((await SlotSession(backend).generate(prompt, config)).token_ids)
    backend, model = run_backend(bigram_table(1), batched=False, slots=2)
    shared_row(model)
    together, sessions = await decode_together(backend, prompts, [config, config])
    assert together == solo
    for session in sessions:
        await assert_kv_is_tokens(session)


def test_decode_run_is_between_1_and_64() -> None:
    for bad in (0, 65):
        with pytest.raises(pydantic.ValidationError, match="decode_run"):
            GenerationConfig(decode_run=bad)
