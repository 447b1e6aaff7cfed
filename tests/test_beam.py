"""Tests for agentkv.engine.decode.beam: BeamSearch against brute force on synthetic models, beam_idx
reordering of a fake KV batch, EOS / stop handling, length penalty and the KV-collapse winner."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import BeamHypothesis
from agentkv.engine.decode.beam import BeamSearch, BeamWinner
from agentkv.engine.decode.sampling import log_softmax
from agentkv.errors import UserError

EOS = 0
PROMPT_LEN = 5
Prefix = tuple[int, ...]
LogitsFn = Callable[[Prefix], np.ndarray]


def random_model(vocab: int, salt: int) -> LogitsFn:
    """Deterministic pseudo-random logits for every prefix of generated tokens."""

    def logits(prefix: Prefix) -> np.ndarray:
        rng = np.random.default_rng([salt, len(prefix), *prefix])
        return (rng.standard_normal(vocab) * 2.0).astype(np.float32)

    return logits


def table_model(table: dict[Prefix, list[float]], default: list[float]) -> LogitsFn:
    """Logits from a table of next-token probabilities per prefix."""
    return lambda prefix: np.log(np.array(table.get(prefix, default), dtype=np.float32))


class FakeKV:
    """A stateful model's KV batch: each row is the tokens it holds; ``beam_idx`` reorders."""

    def __init__(self, model: LogitsFn) -> None:
        self.model = model
        self.rows: list[Prefix] = [()]
        self.feeds: list[tuple[list[int], list[int]]] = []

    def logits(self) -> np.ndarray:
        return np.stack([self.model(row) for row in self.rows])  # [rows, vocab]

    def infer(self, beam_idx: np.ndarray, next_tokens: np.ndarray) -> np.ndarray:
        assert beam_idx.dtype == np.int32 and next_tokens.dtype == np.int64
        self.feeds.append((beam_idx.tolist(), next_tokens.tolist()))
        self.rows = [self.rows[int(i)] + (int(t),) for i, t in zip(beam_idx, next_tokens)]
        return self.logits()


def new_search(config: GenerationConfig) -> BeamSearch:
    return BeamSearch(config, frozenset({EOS}), prompt_len=PROMPT_LEN)


def common_prefix(a: Prefix, b: Prefix) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run(
    model: LogitsFn, config: GenerationConfig, eos: frozenset[int] = frozenset({EOS})
) -> tuple[list[BeamHypothesis], BeamWinner, FakeKV]:
    kv = FakeKV(model)
    search = BeamSearch(config, eos, prompt_len=PROMPT_LEN)
    logits = kv.logits()
    while (step := search.step(logits)) is not None:
        logits = kv.infer(step.beam_idx, step.next_tokens)
    return search.finalize(), search.winner, kv


def sequence_logprob(model: LogitsFn, tokens: Prefix) -> float:
    return sum(float(log_softmax(model(tokens[:i]))[t]) for i, t in enumerate(tokens))


def brute_force(
    model: LogitsFn, vocab: int, max_new: int, count: int
) -> list[tuple[Prefix, float]]:
    """Every hypothesis (EOS-terminated, or max_new tokens long) ranked by summed log-prob."""
    words = range(1, vocab)
    hypotheses = [
        (*body, EOS)
        for length in range(max_new)
        for body in itertools.product(words, repeat=length)
    ]
    hypotheses += list(itertools.product(words, repeat=max_new))
    scored = [(h, sequence_logprob(model, h)) for h in hypotheses]
    return sorted(scored, key=lambda item: -item[1])[:count]


def assert_winner_row_is_consistent(winner: BeamWinner, kv: FakeKV) -> None:
    commons = [common_prefix(winner.token_ids, row) for row in kv.rows]
    assert winner.common_tokens == max(commons)
    assert kv.rows[winner.row][: winner.common_tokens] == winner.token_ids[: winner.common_tokens]
    assert winner.kv_len == PROMPT_LEN + winner.common_tokens


@settings(max_examples=60, deadline=None)
@given(
    vocab=st.integers(3, 4),
    max_new=st.integers(1, 3),
    salt=st.integers(0, 10_000),
    count=st.integers(1, 4),
)
def test_exhaustive_beams_without_length_penalty_find_the_brute_force_best(
    vocab: int, max_new: int, salt: int, count: int
) -> None:
    # NOTE: with num_beams ≥ every candidate of the last step nothing is ever pruned, and with
    # length_penalty=0 a prefix bounds its continuations, so the heuristic stop is exact too.
    num_beams = vocab * (vocab - 1) ** (max_new - 1)
    count = min(count, num_beams)
    model = random_model(vocab, salt)
    config = GenerationConfig(
        num_beams=num_beams,
        num_return_sequences=count,
        max_new_tokens=max_new,
        length_penalty=0.0,
    )
    hypotheses, winner, kv = run(model, config)
    expected = brute_force(model, vocab, max_new, count)
    assert [h.token_ids for h in hypotheses] == [tokens for tokens, _ in expected]
    np.testing.assert_allclose([h.score for h in hypotheses], [s for _, s in expected], atol=1e-4)
    assert_winner_row_is_consistent(winner, kv)


@settings(max_examples=40, deadline=None)
@given(
    salt=st.integers(0, 10_000),
    num_beams=st.integers(2, 5),
    max_new=st.integers(1, 8),
    length_penalty=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
def test_hypothesis_scores_are_their_summed_logprobs_over_length_to_the_penalty(
    salt: int, num_beams: int, max_new: int, length_penalty: float
) -> None:
    model = random_model(50, salt)
    config = GenerationConfig(
        num_beams=num_beams,
        num_return_sequences=num_beams,
        max_new_tokens=max_new,
        length_penalty=length_penalty,
    )
    hypotheses, winner, kv = run(model, config)
    assert len(hypotheses) == num_beams
    assert [h.score for h in hypotheses] == sorted((h.score for h in hypotheses), reverse=True)
    assert len({h.token_ids for h in hypotheses}) == num_beams
    for h in hypotheses:
        assert 1 <= len(h.token_ids) <= max_new
        assert EOS not in h.token_ids[:-1]
        expected = sequence_logprob(model, h.token_ids) / len(h.token_ids) ** length_penalty
        assert h.score == pytest.approx(expected, abs=1e-4)
    assert winner.token_ids == hypotheses[0].token_ids
    assert_winner_row_is_consistent(winner, kv)


# Prompt → 1 (0.5) beats 2 (0.39), but 2 → 3 (0.96) makes "2 3" the better pair.
GREEDY_TRAP = {
    (): [0.01, 0.5, 0.39, 0.05, 0.05],
    (1,): [0.01, 0.3, 0.29, 0.2, 0.2],
    (2,): [0.01, 0.01, 0.01, 0.96, 0.01],
}


def test_first_step_expands_the_prompt_row_into_the_best_distinct_tokens() -> None:
    search = new_search(GenerationConfig(num_beams=2, max_new_tokens=3))
    step = search.step(table_model(GREEDY_TRAP, [0.6, 0.1, 0.1, 0.1, 0.1])(())[None, :])
    assert step is not None
    assert step.beam_idx.tolist() == [0, 0]
    assert step.next_tokens.tolist() == [1, 2]


def test_beam_idx_reorders_the_kv_rows_and_finds_what_greedy_misses() -> None:
    model = table_model(GREEDY_TRAP, default=[0.6, 0.1, 0.1, 0.1, 0.1])
    config = GenerationConfig(num_beams=2, max_new_tokens=3, num_return_sequences=2)
    hypotheses, winner, kv = run(model, config)
    # step 2: the best child continues row 1 ("2" → "2 3"), the second continues row 0
    assert kv.feeds == [([0, 0], [1, 2]), ([1, 0], [3, 1])]
    assert kv.rows == [(2, 3), (1, 1)]
    assert [h.token_ids for h in hypotheses] == [(2, 3, EOS), (1, 1, EOS)]
    assert winner == BeamWinner(
        token_ids=(2, 3, EOS), row=0, kv_len=PROMPT_LEN + 2, common_tokens=2, finish_reason="stop"
    )


def test_num_return_sequences_limits_the_returned_hypotheses() -> None:
    model = random_model(30, salt=3)
    for count in (1, 2, 4):
        config = GenerationConfig(num_beams=4, num_return_sequences=count, max_new_tokens=6)
        hypotheses, _, _ = run(model, config)
        assert len(hypotheses) == count
    config = GenerationConfig(num_beams=4, num_return_sequences=4, max_new_tokens=6)
    best_of_four = run(model, config)[0]
    assert run(model, GenerationConfig(num_beams=4, max_new_tokens=6))[0] == best_of_four[:1]


def test_an_eos_ranked_below_num_beams_does_not_finish_a_hypothesis() -> None:
    model = table_model({(): [0.2, 0.4, 0.35, 0.04, 0.01]}, default=[0.3, 0.25, 0.2, 0.15, 0.1])

    def best(num_beams: int) -> Prefix:
        config = GenerationConfig(num_beams=num_beams, max_new_tokens=2, length_penalty=0.0)
        return run(model, config)[0][0].token_ids

    assert best(3) == (EOS,)  # EOS is the 3rd candidate: within 3 beams it finishes, and wins
    assert best(2) == (1, EOS)  # outside 2 beams it is skipped, though it would have won


def test_length_penalty_trades_a_short_eos_against_a_longer_likely_answer() -> None:
    model = table_model(
        {
            (): [0.5, 0.45, 0.03, 0.01, 0.01],
            (1,): [0.005, 0.97, 0.015, 0.005, 0.005],
            (1, 1): [0.97, 0.0075, 0.0075, 0.0075, 0.0075],
        },
        default=[0.6, 0.1, 0.1, 0.1, 0.1],
    )

    def best(length_penalty: float) -> BeamHypothesis:
        config = GenerationConfig(num_beams=2, max_new_tokens=3, length_penalty=length_penalty)
        return run(model, config)[0][0]

    assert best(0.0).token_ids == (EOS,)
    assert best(0.0).score == pytest.approx(np.log(0.5), abs=1e-5)
    # the EOS counts in the length: 3 tokens, not 2
    long = best(1.0)
    assert long.token_ids == (1, 1, EOS)
    assert long.score == pytest.approx(np.log(0.45 * 0.97 * 0.97) / 3, abs=1e-5)


def test_search_stops_early_once_no_live_beam_can_beat_the_finished_ones() -> None:
    model = table_model({(): [0.9, 0.04, 0.03, 0.02, 0.01]}, default=[0.6, 0.1, 0.1, 0.1, 0.1])
    config = GenerationConfig(num_beams=2, max_new_tokens=50, num_return_sequences=2)
    hypotheses, winner, kv = run(model, config)
    assert len(kv.feeds) == 1  # step 2 ended the search (openvino-genai's HEURISTIC rule)
    assert [h.token_ids for h in hypotheses] == [(EOS,), (1, EOS)]
    # the winner finished before the live rows diverged from it: re-prefill from the prompt
    assert winner == BeamWinner(
        token_ids=(EOS,), row=0, kv_len=PROMPT_LEN, common_tokens=0, finish_reason="stop"
    )


def test_max_new_tokens_finishes_live_beams_without_feeding_their_last_token() -> None:
    model = table_model({}, default=[0.001, 0.4, 0.3, 0.2, 0.099])
    config = GenerationConfig(num_beams=3, max_new_tokens=4)
    hypotheses, winner, kv = run(model, config)
    assert len(kv.feeds) == 3
    assert hypotheses[0].token_ids == (1, 1, 1, 1)
    assert winner.finish_reason == "length"
    assert winner.common_tokens == 3
    assert kv.rows[winner.row] == (1, 1, 1)


def test_ignore_eos_treats_the_eos_token_as_an_ordinary_token() -> None:
    model = table_model({}, default=[0.7, 0.1, 0.1, 0.05, 0.05])
    config = GenerationConfig(num_beams=2, max_new_tokens=3, ignore_eos=True)
    hypotheses, winner, _ = run(model, config)
    assert hypotheses[0].token_ids == (EOS, EOS, EOS)
    assert winner.finish_reason == "length"


def test_config_stop_token_ids_finish_hypotheses_like_eos() -> None:
    model = table_model({}, default=[0.05, 0.1, 0.1, 0.7, 0.05])
    config = GenerationConfig(num_beams=2, max_new_tokens=5, stop_token_ids=frozenset({3}))
    hypotheses, winner, _ = run(model, config)
    assert hypotheses[0].token_ids == (3,)
    assert winner.finish_reason == "stop"


def test_zero_max_new_tokens_returns_one_empty_hypothesis() -> None:
    search = new_search(GenerationConfig(num_beams=2, max_new_tokens=0))
    assert search.step(np.zeros((1, 5), np.float32)) is None
    assert search.finalize() == [BeamHypothesis(token_ids=(), score=0.0)]
    assert search.winner.kv_len == PROMPT_LEN


def test_logits_with_the_wrong_number_of_rows_are_refused() -> None:
    search = new_search(GenerationConfig(num_beams=2))
    with pytest.raises(UserError, match=r"shape \[1, vocab\]"):
        search.step(np.zeros((2, 5), np.float32))


def test_a_finished_search_stays_finished_and_finalize_is_repeatable() -> None:
    model = random_model(20, salt=9)
    kv = FakeKV(model)
    search = new_search(GenerationConfig(num_beams=3, max_new_tokens=4))
    with pytest.raises(UserError, match="still running"):
        _ = search.winner
    logits = kv.logits()
    while (step := search.step(logits)) is not None:
        logits = kv.infer(step.beam_idx, step.next_tokens)
    assert search.done
    assert search.step(logits) is None
    assert search.finalize() == search.finalize()


def test_finalize_on_an_interrupted_search_finishes_the_live_beams() -> None:
    model = random_model(20, salt=4)
    kv = FakeKV(model)
    search = new_search(GenerationConfig(num_beams=2, max_new_tokens=50))
    step = search.step(kv.logits())
    assert step is not None
    kv.infer(step.beam_idx, step.next_tokens)
    hypotheses = search.finalize()
    assert [len(h.token_ids) for h in hypotheses] == [1]
    assert_winner_row_is_consistent(search.winner, kv)


def test_penalties_are_refused_rather_than_silently_ignored() -> None:
    config = GenerationConfig(num_beams=2, repetition_penalty=1.2)
    with pytest.raises(UserError, match="penalt"):
        BeamSearch(config, frozenset({EOS}), PROMPT_LEN)
