"""Prompt-lookup drafts in sampled calls (``engine/decode/prompt_lookup.py``, ``sampling.py``,
``loop.py``): the speculative rule accepts a drafted token with the probability the sampler gives it
and otherwise draws from the rest; whole sampled calls keep their distribution and, seeded, their
very tokens with drafts on or off; a call closed or cancelled with a draft ahead leaves only
plain decoding's tokens in the KV log; ``steps_saved`` counts confirmed drafted tokens. A paged
backend runs over a fake model (a random bigram table; its "KV" at a position is the token there).

Bounds: a chi-square statistic is compared with its 0.999 quantile (Wilson–Hilferty), so each
check fails by chance about once in a thousand runs — and the seeds are fixed, so never at random."""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Callable

import anyio
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.fast_forward import FastForwardCounts
from agentkv.engine.decode.prompt_lookup import Drafts, PromptLookup
from agentkv.engine.decode.sampling import make_rng, sample_next, target_distribution
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import BLOCK_SIZE, SequenceStep
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.session import SlotSession
from agentkv.testing import ScriptedTokenizer
from _drive import DRIVERS, blocking_executor, drive
from _fake_grammars import NoZeroAndForcedPair

VOCAB = 8
Z_999 = 3.0902  # the standard normal's 0.999 quantile
SAMPLED = GenerationConfig(temperature=0.8, top_p=0.95, presence_penalty=0.3, max_new_tokens=8)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # repetitive: drafts are proposed


def chi2_critical(df: int) -> float:
    """The 0.999 quantile of chi-square with ``df`` degrees of freedom (Wilson–Hilferty; within 1 % for df >= 3)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + Z_999 * math.sqrt(h)) ** 3


def chi2_against(counts: Counter[int], expected: dict[int, float], n: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` (n draws) against probabilities ``expected`` (cells below 5
    expected draws pooled into one), and its degrees of freedom. A count outside ``expected`` fails."""
    assert set(counts) <= {k for k, p in expected.items() if p > 0}, "drew a token of probability 0"
    cells, rare_obs, rare_exp = [], 0, 0.0
    for key, p in expected.items():
        if n * p >= 5:
            cells.append((counts.get(key, 0), n * p))
        else:
            rare_obs, rare_exp = rare_obs + counts.get(key, 0), rare_exp + n * p
    if rare_exp > 0:
        cells.append((rare_obs, rare_exp))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def bigram_table(seed: int) -> np.ndarray:
    """Logits ``[VOCAB, VOCAB]``: row ``t`` follows token ``t``; each row favours its successor ``t + 1``
    (what the prompt repeats), so drafts are often but not always right."""
    table = np.random.default_rng(seed).normal(scale=1.0, size=(VOCAB, VOCAB)).astype(np.float32)
    table[np.arange(VOCAB), (np.arange(VOCAB) % (VOCAB - 1)) + 1] += 2.0
    return table


class BigramPagedModel:
    """A paged model whose logits after a token are its bigram row; the "KV" of a position is its token."""

    kv_cache_precision = "f32"

    def __init__(self, pool: BlockPool, table: np.ndarray) -> None:
        self.pool, self.table = pool, table
        self.lock = threading.RLock()
        self.keys = np.full((pool.num_blocks, 1, BLOCK_SIZE, 1), -1.0, dtype=np.float32)
        self.values = self.keys.copy()

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        if while_running is not None:
            while_running()
        row = self.step([SequenceStep([token], past_len, blocks)])[0]
        return int(np.argmax(row)), row

    def step(self, sequences: list[SequenceStep]) -> np.ndarray:
        rows = []
        for seq in sequences:
            for offset, token in enumerate(seq.ids):
                position = seq.past_len + offset
                block = seq.blocks[position // BLOCK_SIZE]
                self.keys[block, 0, position % BLOCK_SIZE, 0] = token
                self.values[block, 0, position % BLOCK_SIZE, 0] = token
            rows += [self.table[token] for token in seq.ids[len(seq.ids) - seq.last_rows:]]
        return np.stack(rows)

    def copy_block(self, source: int, target: int) -> None:
        self.keys[target], self.values[target] = self.keys[source], self.values[source]

    def cache_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(self.keys, self.values)]


def make_session(table: np.ndarray) -> SlotSession:
    pool = BlockPool(16)
    model = BigramPagedModel(pool, table)
    backend = PagedBackend(model, pool, slots=[PagedSlot(model, pool)],  # type: ignore[arg-type]
                           tokenizer=ScriptedTokenizer(), fingerprint="bigram",
                           eos_token_ids={ScriptedTokenizer().eos_token_id}, max_context_len=4096,
                           kv_bytes_per_token=8)
    return SlotSession(backend)


async def assert_kv_is_tokens(session: SlotSession) -> None:
    snapshot = await session.snapshot()
    assert snapshot.tokens == session.tokens
    assert snapshot.to_float()[0][0, 0, 0, :, 0].astype(int).tolist() == list(session.tokens)


# ---- the rule alone ---------------------------------------------------------------------------

def test_the_rule_accepts_a_draft_with_its_probability_and_otherwise_draws_from_the_renormalised_rest():
    logits = np.random.default_rng(5).normal(scale=2.0, size=40).astype(np.float32)
    allowed = np.ones(40, dtype=bool)
    allowed[::7] = False
    config = GenerationConfig(temperature=0.7, top_k=30, top_p=0.97, min_p=0.01, repetition_penalty=1.2)
    kw = {"context_ids": [1, 2, 3, 9], "generated_ids": [9], "allowed": allowed}
    p = target_distribution(logits, config, **kw).probabilities(40)
    draft = int(np.argsort(-p)[1])  # the second most likely: accepted about p(draft) of the time
    n, rng = 10_000, make_rng(11)
    tokens = [sample_next(logits, config, rng, **kw) for _ in range(n)]  # the loop's draw from a verify row
    accepted = sum(t == draft for t in tokens)
    sigma = math.sqrt(n * p[draft] * (1 - p[draft]))
    assert abs(accepted - n * p[draft]) <= Z_999 * sigma * 1.2  # two-sided 0.999, a margin for the pooled p
    residual = {int(t): float(p[t] / (1 - p[draft])) for t in np.flatnonzero(p) if t != draft}
    rejected = Counter(t for t in tokens if t != draft)
    statistic, df = chi2_against(rejected, residual, n - accepted)
    assert statistic < chi2_critical(df), (statistic, df)
    forbidden = 7  # masked: probability 0, never accepted
    assert p[forbidden] == 0 and forbidden not in tokens


def test_target_distribution_is_what_sample_next_draws_from():
    logits = np.random.default_rng(2).normal(scale=1.5, size=20).astype(np.float32)
    config = GenerationConfig(temperature=1.3, top_p=0.9, frequency_penalty=0.5)
    kw = {"context_ids": [4, 4], "generated_ids": [4, 4, 6]}
    p = target_distribution(logits, config, **kw).probabilities(20)
    assert p.sum() == pytest.approx(1.0) and p[4] < np.exp(logits[4]) / np.exp(logits).sum()
    n, rng = 10_000, make_rng(3)
    counts = Counter(sample_next(logits, config, rng, **kw) for _ in range(n))
    statistic, df = chi2_against(counts, {t: float(p[t]) for t in np.flatnonzero(p)}, n)
    assert statistic < chi2_critical(df), (statistic, df)
    greedy = target_distribution(logits, GenerationConfig(), **kw)
    assert greedy.greedy and greedy.token_ids().tolist() == [int(np.argmax(logits))]


# ---- whole calls --------------------------------------------------------------------------------

async def sampled_calls(seeds: range, *, drafts: bool, grammar: bool = False, config: GenerationConfig = SAMPLED):
    """One sampled call per seed on one session (each aligns back to ``PROMPT``): the results, and
    the session's tokens after each call checked against its KV."""
    session = make_session(bigram_table(0))
    results, logs = [], []
    for seed in seeds:
        cfg = config.model_copy(update={"seed": seed, "prompt_lookup": drafts})
        result = await session.generate(PROMPT, cfg, constraint=NoZeroAndForcedPair(VOCAB) if grammar else None)
        results.append(result)
        logs.append(session.tokens)
    await assert_kv_is_tokens(session)
    await session.close()
    return results, logs


@pytest.mark.parametrize("grammar", [False, True], ids=["free", "grammar"])
async def test_a_seeded_sampled_call_draws_the_same_tokens_and_log_with_drafts_on_or_off(grammar):
    on, on_logs = await sampled_calls(range(60), drafts=True, grammar=grammar)
    off, off_logs = await sampled_calls(range(60), drafts=False, grammar=grammar)
    assert [r.token_ids for r in on] == [r.token_ids for r in off] and on_logs == off_logs
    assert len({r.token_ids for r in on}) > 30  # the seeds do sample different answers
    assert sum(r.metrics.accepted_tokens for r in on) > 0 and all(r.metrics.drafted_tokens == 0 for r in off)
    for fast, plain in zip(on, off):  # steps_saved: the steps not run against one per token
        m, p = fast.metrics, plain.metrics
        assert m.model_steps - p.model_steps == p.steps_saved - m.steps_saved
        if not grammar:  # each confirmed drafted token (all accepted ones but one that ended the call)
            assert p.steps_saved == 0 and m.steps_saved in (m.accepted_tokens, m.accepted_tokens - 1)


def triple_probabilities(table: np.ndarray, config: GenerationConfig) -> dict[tuple[int, ...], float]:
    """The exact distribution of the first three sampled tokens after ``PROMPT`` (no grammar)."""
    out: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(3):
        grown: dict[tuple[int, ...], float] = {}
        for prefix, mass in out.items():
            last = prefix[-1] if prefix else PROMPT[-1]
            p = target_distribution(table[last], config, context_ids=PROMPT, generated_ids=prefix).probabilities(VOCAB)
            for token in np.flatnonzero(p):
                grown[(*prefix, int(token))] = mass * float(p[token])
        out = grown
    return out


async def test_drafts_on_and_off_sample_the_first_three_tokens_from_the_same_distribution():
    n = 1000
    on, _ = await sampled_calls(range(n), drafts=True)
    off, _ = await sampled_calls(range(n, 2 * n), drafts=False)  # other seeds: independent samples
    exact = triple_probabilities(bigram_table(0), SAMPLED)
    on_counts, off_counts = Counter(r.token_ids[:3] for r in on), Counter(r.token_ids[:3] for r in off)
    for counts in (on_counts, off_counts):
        statistic, df = chi2_against(counts, exact, n)
        assert statistic < chi2_critical(df), (statistic, df)
    # two-sample (equal sizes): sum (a - b)^2 / (a + b) over cells seen, df = cells - 1
    cells = [(on_counts[k], off_counts[k]) for k in set(on_counts) | set(off_counts)]
    common = [(a, b) for a, b in cells if a + b >= 10]
    rare = (sum(a for a, b in cells if a + b < 10), sum(b for a, b in cells if a + b < 10))
    cells = common + ([rare] if sum(rare) else [])
    statistic = sum((a - b) ** 2 / (a + b) for a, b in cells)
    assert statistic < chi2_critical(len(cells) - 1), (statistic, len(cells))
    accepted = sum(r.metrics.accepted_tokens for r in on)
    assert accepted > n // 4, accepted  # drafts were really used


# ---- closing and cancelling with a draft ahead -----------------------------------------------

def counting_table() -> np.ndarray:
    """Logits that almost always continue 1..7, 1..7: every draft is accepted, so one is always ahead."""
    table = np.full((VOCAB, VOCAB), -4.0, dtype=np.float32)
    table[np.arange(VOCAB), (np.arange(VOCAB) % (VOCAB - 1)) + 1] = 4.0
    return table


async def close_after(k: int, drafts_on: bool, config: GenerationConfig, driver: str = "event-loop"
                      ) -> tuple[list[int], list[int], Drafts | None]:
    """The token loop over a fake log through ``driver``, closed (``aclose``) after ``k`` deltas:
    the tokens taken, the log, the drafts."""
    table = counting_table()
    log = list(PROMPT)
    last = [table[log[-1]]]

    def feed(ids: list[int]) -> None:
        log.extend(ids)
        last[0] = table[log[-1]]

    def feed_rows(ids: list[int], rows: int) -> np.ndarray:
        log.extend(ids)
        return np.stack([table[t] for t in ids[len(ids) - rows:]])

    def trim(keep: int) -> None:
        del log[len(PROMPT) + keep:]

    drafts = Drafts(PromptLookup(PROMPT)) if drafts_on else None
    rng = make_rng(config.seed)

    def choose(generated: list[int]) -> int:
        logits = drafts.logits if drafts is not None and drafts.logits is not None else last[0]
        return sample_next(logits, config, rng, context_ids=log, generated_ids=generated)

    steps = TokenSteps(choose, config=config, decode_text=lambda ids: "x" * len(ids), stop_ids=frozenset(),
                       max_new=config.max_new_tokens, counts=FastForwardCounts(), drafts=drafts)
    events = drive(steps, blocking_executor(feed, feed_rows, trim), driver)
    taken: list[int] = []
    async for event in events:
        assert isinstance(event, TokenDelta) and not isinstance(event, DecodeOutcome)
        taken.append(event.token_id)
        if len(taken) == k:
            break
    await events.aclose()
    return taken, log, drafts


@pytest.mark.parametrize("k", [2, 3, 5, 9])  # the first token comes before any draft
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_closing_the_stream_with_a_draft_ahead_leaves_plain_decodings_log(k, temperature, driver):
    config = GenerationConfig(temperature=temperature, seed=4, max_new_tokens=30)
    plain_taken, plain_log, _ = await close_after(k, False, config)
    taken, log, drafts = await close_after(k, True, config, driver)
    assert drafts is not None and drafts.drafted > 0 and not drafts.ahead
    assert taken == plain_taken and log == plain_log == PROMPT + taken[:-1]


async def test_cancelling_a_sampled_call_with_a_draft_ahead_trims_the_draft_from_the_session():
    # NOTE: a cancel is delivered at the loop's next wait: a feed (no draft ahead then) or the trim
    # of a refused draft (the draft still in the KV): the bigram model refuses some drafts
    session = make_session(bigram_table(0))
    for seed in range(40):
        config = GenerationConfig(temperature=0.9, seed=seed, max_new_tokens=40)
        taken: list[int] = []
        with anyio.CancelScope() as scope:
            async for delta in session.stream(PROMPT, config):
                taken.append(delta.token_id)
                if len(taken) == 3:
                    scope.cancel()
        assert scope.cancelled_caught
        tokens = list(session.tokens)
        assert tokens[:len(PROMPT)] == PROMPT and len(tokens) - len(PROMPT) <= len(taken)
        assert tokens[len(PROMPT):] == taken[:len(tokens) - len(PROMPT)]  # generated tokens only, no draft
        await assert_kv_is_tokens(session)
    again = await session.generate(PROMPT, config)  # and the session goes on from there
    assert again.token_ids[:len(taken)] == tuple(taken)
    await session.close()


async def test_closing_a_sessions_stream_with_a_draft_ahead_leaves_plain_decodings_log():
    # NOTE: the session closes its DecodeLoop.run() in the consumer's task when the stream closes
    # (else the loop is finalized later, in another task, and no trim runs)
    session = make_session(counting_table())
    for seed in range(10):
        config = GenerationConfig(temperature=0.9, seed=seed, max_new_tokens=40)
        stream, taken = session.stream(PROMPT, config), []
        async for delta in stream:
            taken.append(delta.token_id)
            if len(taken) == 5:
                break
        await stream.aclose()
        assert list(session.tokens) == PROMPT + taken[:-1]
        await assert_kv_is_tokens(session)
    await session.close()
