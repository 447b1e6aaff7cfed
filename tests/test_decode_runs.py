"""Tests of runs in the decode loop (issue 27): ``TokenSteps`` with ``pick`` feeds through
``RunStep``s (several one-token steps back to back) and gives the same tokens, text and KV log as
one-by-one decoding, through both drivers, with stop ids, stop strings, ``max_new_tokens``, a cancel
between a run's deltas, a loop error between steps and a consumer that leaves mid-run. A paged
session with runs is tested in ``test_decode_run_sessions.py``, the pieces a run is made of in
``test_decode_run_pieces.py``. No model runs here: fakes, and the bigram table of
``test_speculative_sampling``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.fast_forward import FastForwardCounts
from agentkv.engine.decode.model_steps import FeedRowsStep, FeedStep, ModelStep, RunStep, TrimStep
from agentkv.engine.decode.prompt_lookup import Drafts, PromptLookup
from agentkv.engine.decode.sampling import greedy_pick, make_rng, sample_next
from agentkv.engine.decode.threaded import run_steps_in_thread
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from _drive import DRIVERS, drive
from test_speculative_sampling import bigram_table, counting_table

VOCAB = 8
PROMPT = [1, 2, 3]
REPEATING = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3]


def random_table(seed: int) -> np.ndarray:
    """Bigram logits ``[VOCAB, VOCAB]`` with no favoured successor: the prompt's repeats make drafts
    the model often refuses (back-offs, then runs), its own greedy cycle drafts it accepts."""
    return np.random.default_rng(seed).normal(scale=1.5, size=(VOCAB, VOCAB)).astype(np.float32)


def text_of(ids: Sequence[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


# ---- a fake log that runs every model step, runs included ---------------------------------------

class BigramLog:
    """The session's tokens (prompt first) over a bigram "model": the logits after a token are its
    row of ``table``. Runs ``RunStep`` as ``KVLog.feed_run`` does (feed, then feed each chosen token
    but the last); remembers the runs, the longest log and an optional per-token delay."""

    def __init__(self, table: np.ndarray, prompt: Sequence[int], *, step_s: float = 0.0) -> None:
        self.table, self.prompt, self.step_s = table, list(prompt), step_s
        self.tokens = list(prompt)
        self.last = table[self.tokens[-1]]
        self.runs: list[list[int]] = []  # each run's chosen tokens
        self.run_steps: list[int] = []  # each RunStep's ``steps``
        self.longest = len(self.tokens)
        self.run_started = threading.Event()

    def _fed(self, ids: Sequence[int]) -> None:
        if self.step_s:
            time.sleep(self.step_s)
        self.tokens.extend(int(t) for t in ids)
        self.last = self.table[self.tokens[-1]]
        self.longest = max(self.longest, len(self.tokens))

    def execute(self, step: ModelStep) -> Any:
        if isinstance(step, TrimStep):
            del self.tokens[len(self.prompt) + step.keep:]
            self.last = self.table[self.tokens[-1]]
            return None
        if isinstance(step, RunStep):
            self.run_steps.append(step.steps)
            if step.started is not None:  # as KVLog.feed_run on a slot without runs: before the first feed
                step.started()
            self._fed(step.ids)
            self.run_started.set()
            chosen: list[int] = []
            while True:
                chosen.append(step.choose(self.last))
                if len(chosen) >= step.steps or step.ends(chosen[-1]):
                    break
                self._fed(chosen[-1:])
            self.runs.append(chosen)
            return chosen
        if isinstance(step, FeedRowsStep):
            self._fed(step.ids)
            return np.stack([self.table[t] for t in step.ids[len(step.ids) - step.rows:]])
        assert isinstance(step, FeedStep)
        self._fed(step.ids)
        return None

    @property
    def generated(self) -> list[int]:
        return self.tokens[len(self.prompt):]


def make_steps(log: BigramLog, config: GenerationConfig, *, drafts_on: bool = False,
               stop_ids: frozenset[int] = frozenset()) -> tuple[TokenSteps, Drafts | None]:
    """``TokenSteps`` over ``log`` choosing as ``DecodeLoop`` does (one seeded stream shared by
    ``choose`` and ``pick``), with ``pick`` as ``DecodeLoop.picker`` gives it."""
    drafts = Drafts(PromptLookup(log.prompt)) if drafts_on else None
    rng = make_rng(config.seed)

    def choose(generated: list[int]) -> int:
        logits = drafts.logits if drafts is not None and drafts.logits is not None else log.last
        return int(sample_next(logits, config, rng))

    def sampled_pick(logits: np.ndarray) -> int:
        return int(sample_next(logits, config, rng))

    pick: Callable[[np.ndarray], int] = greedy_pick if config.greedy else sampled_pick
    steps = TokenSteps(choose, config=config, decode_text=text_of, stop_ids=stop_ids, max_new=config.max_new_tokens,
                       counts=FastForwardCounts(), drafts=drafts, pick=pick)
    return steps, drafts


async def decode(table: np.ndarray, config: GenerationConfig, driver: str, *, prompt: Sequence[int] = PROMPT,
                 drafts_on: bool = False, stop_ids: frozenset[int] = frozenset()
                 ) -> tuple[list[int], str, DecodeOutcome, BigramLog]:
    """A whole call: the deltas' tokens, their text, the outcome, the log."""
    log = BigramLog(table, prompt)
    steps, _ = make_steps(log, config, drafts_on=drafts_on, stop_ids=stop_ids)
    tokens, pieces, outcome = [], [], None
    async for event in drive(steps, log.execute, driver):
        if isinstance(event, DecodeOutcome):
            outcome = event
        else:
            tokens.append(event.token_id)
            pieces.append(event.text)
    assert outcome is not None
    return tokens, "".join(pieces), outcome, log


CONFIGS = {
    "greedy": GenerationConfig(max_new_tokens=40),
    "sampled": GenerationConfig(max_new_tokens=40, temperature=0.9, seed=3),
}


@pytest.mark.parametrize("drafts_on", [False, True], ids=["plain", "drafts"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("driver", DRIVERS)
async def test_runs_of_eight_give_the_tokens_text_and_log_of_one_by_one_decoding(
        driver: str, name: str, drafts_on: bool) -> None:
    for seed in range(4):
        table = random_table(seed) if drafts_on else bigram_table(seed)
        prompt = REPEATING if drafts_on else PROMPT
        one = CONFIGS[name].model_copy(update={"decode_run": 1})
        eight = CONFIGS[name].model_copy(update={"decode_run": 8})
        tokens1, text1, outcome1, log1 = await decode(table, one, driver, prompt=prompt, drafts_on=drafts_on)
        tokens8, text8, outcome8, log8 = await decode(table, eight, driver, prompt=prompt, drafts_on=drafts_on)
        assert log1.runs == [] and log8.runs, "decode_run=8 ran no RunStep"
        assert drafts_on or max(len(run) for run in log8.runs) > 1
        assert tokens8 == tokens1 and outcome8.generated == outcome1.generated
        assert text8 == text1 == outcome8.text == outcome1.text
        assert outcome8.finish_reason == outcome1.finish_reason
        assert log8.tokens == log1.tokens == [*prompt, *outcome1.generated[:-1]]


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_stop_id_chosen_inside_a_run_ends_generation_there_and_never_enters_the_log(driver: str) -> None:
    config = GenerationConfig(max_new_tokens=40, decode_run=8)  # counting 4, 5, 6, 7, 1, ...: 7 inside the first run
    tokens, _, outcome, log = await decode(counting_table(), config, driver, stop_ids=frozenset({7}))
    assert log.runs and log.runs[0][-1] == 7 and len(log.runs[0]) > 1  # the run ended at the stop id
    assert outcome.generated == [4, 5, 6, 7] and outcome.finish_reason == "stop"
    assert tokens == [4, 5, 6]  # the stop token makes no delta
    assert log.tokens == [*PROMPT, 4, 5, 6] and 7 not in log.generated
    one, _, outcome1, log1 = await decode(counting_table(), config.model_copy(update={"decode_run": 1}), driver,
                                          stop_ids=frozenset({7}))
    assert (one, outcome1.generated, log1.tokens) == (tokens, outcome.generated, log.tokens)


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_stop_string_completed_inside_a_run_trims_what_the_run_fed_beyond_one_by_one_decodings_log(
        driver: str) -> None:
    # counting: 4, 5, 6, 7, 1, 2, ...; "<6><7>" completes at the 4th token, inside the first run of 8
    config = GenerationConfig(max_new_tokens=40, decode_run=8, stop_strings=("<6><7>",))
    tokens, text, outcome, log = await decode(counting_table(), config, driver)
    tokens1, text1, outcome1, log1 = await decode(counting_table(), config.model_copy(update={"decode_run": 1}), driver)
    assert log.longest > len(log1.tokens)  # the run fed past the stop string …
    assert log.tokens == log1.tokens == [*PROMPT, 4, 5, 6]  # … and that was trimmed
    assert (tokens, text, outcome.generated, outcome.finish_reason) == (tokens1, text1, outcome1.generated, "stop")
    assert text == "<4><5>"


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("max_new", [1, 2, 3, 8, 9, 10, 17])
async def test_a_run_never_chooses_or_feeds_beyond_max_new_tokens(driver: str, max_new: int) -> None:
    config = GenerationConfig(max_new_tokens=max_new, decode_run=8)
    tokens, _, outcome, log = await decode(counting_table(), config, driver)
    assert len(outcome.generated) == len(tokens) == max_new and outcome.finish_reason == "length"
    assert sum(len(run) for run in log.runs) <= max_new - 1  # the first token is chosen before any run
    assert log.longest <= len(PROMPT) + max_new - 1
    assert log.tokens == [*PROMPT, *outcome.generated[:-1]]
    assert all(steps <= 8 for steps in log.run_steps)


# ---- a consumer that leaves mid-run --------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 2, 3, 5, 9, 12])
@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_consumer_that_leaves_mid_run_leaves_one_by_one_decodings_log_of_its_last_delta(
        driver: str, k: int) -> None:
    log = BigramLog(counting_table(), PROMPT)
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=40, decode_run=8))
    events = drive(steps, log.execute, driver)
    taken: list[int] = []
    async for event in events:
        assert isinstance(event, TokenDelta)
        taken.append(event.token_id)
        if len(taken) == k:
            if driver == "thread":  # a run is under way (the first delta is posted before it) …
                assert await anyio.to_thread.run_sync(log.run_started.wait, 5)
                await anyio.sleep(0.02)  # … and the thread runs as far ahead as it may meanwhile
            break
    await events.aclose()
    if driver == "thread" or k > 1:  # the event loop's driver runs nothing ahead of the first delta
        mid_run = k != 9  # the 9th token ends the first run (its first token is chosen before it)
        assert log.runs and log.longest >= len(PROMPT) + len(taken) - 1 + mid_run  # the run fed past the delta
    assert log.tokens == [*PROMPT, *taken[:-1]]


async def test_a_closed_stream_stops_a_run_after_its_current_token() -> None:
    log = BigramLog(counting_table(), PROMPT, step_s=0.01)  # a run of 64 would take ~0.64 s
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=100, decode_run=64))
    events = run_steps_in_thread(steps, log.execute)
    async for event in events:
        assert isinstance(event, TokenDelta)  # the first token: posted as the first run starts
        assert await anyio.to_thread.run_sync(log.run_started.wait, 5)  # close once the run is under way
        break
    await events.aclose()
    assert len(log.runs) == 1 and len(log.runs[0]) < 64
    assert log.tokens == PROMPT



@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_cancel_lands_between_the_deltas_of_one_run(driver: str) -> None:
    log = BigramLog(counting_table(), PROMPT)
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=40, decode_run=8))
    seen = 0
    with anyio.CancelScope() as scope:
        async for event in drive(steps, log.execute, driver):
            assert isinstance(event, TokenDelta)
            seen += 1
            if seen == 4:  # the 2nd..9th deltas come from the first run, with no model step between
                scope.cancel()
    assert seen == 4 and log.runs
    assert log.tokens == [*PROMPT, 4, 5, 6]  # one-by-one decoding's log at the 4th delta


def failing_text(ids: Sequence[int]) -> str:
    if 7 in ids:
        raise ValueError("this tokenizer cannot decode 7")
    return text_of(ids)


@pytest.mark.parametrize("run", [1, 8])
async def test_a_loop_that_fails_between_steps_still_hands_over_every_delta_it_made(run: int) -> None:
    log = BigramLog(counting_table(), PROMPT)
    steps = TokenSteps(lambda generated: greedy_pick(log.last),
                       config=GenerationConfig(max_new_tokens=40, decode_run=run), decode_text=failing_text,
                       stop_ids=frozenset(), max_new=40, pick=greedy_pick)
    got: list[int] = []
    with pytest.raises(ValueError, match="cannot decode 7"):
        async for event in run_steps_in_thread(steps, log.execute):
            assert isinstance(event, TokenDelta)
            got.append(event.token_id)
    assert got == [4, 5, 6]  # every delta before the failing one, runs or not
    assert log.tokens == [*PROMPT, 4, 5, 6]  # the loop failed at 7, after 6 was fed
