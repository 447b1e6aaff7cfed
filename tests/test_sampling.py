"""Tests for agentkv.engine.decode.sampling: every knob of sample_next, penalties, log_softmax and
stop-string matching over streamed text."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.base import GenerationConfig
from agentkv.engine.decode.sampling import (
    StopStringMatcher,
    apply_penalties,
    draw,
    log_softmax,
    make_rng,
    sample_next,
    target_distribution,
    token_logprobs,
)
from agentkv.errors import ConstraintError, UserError

VOCAB = 49_152


def random_logits(seed: int, vocab: int = VOCAB, scale: float = 3.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(vocab) * scale).astype(np.float32)


def draws(logits: np.ndarray, config: GenerationConfig, n: int, seed: int = 0, **kw) -> list[int]:
    rng = make_rng(seed)
    return [sample_next(logits, config, rng, **kw) for _ in range(n)]


def test_temperature_zero_is_argmax_and_leaves_logits_unchanged() -> None:
    logits = random_logits(1)
    before = logits.copy()
    assert sample_next(logits, GenerationConfig(), make_rng(0)) == int(np.argmax(logits))
    np.testing.assert_array_equal(logits, before)


@settings(max_examples=200, deadline=None)
@given(values=st.lists(st.sampled_from([-np.inf, -2.5, 0.0, 0.0, 1.0, 7.25, 7.25, 7.25 + 1e-9, np.inf, np.nan]),
                       min_size=1, max_size=12),
       dtype=st.sampled_from([np.float16, np.float32, np.float64]), row=st.booleans())
def test_plain_greedy_takes_the_distributions_token_without_building_it(values: list[float], dtype: type,
                                                                         row: bool) -> None:
    # the shortcut in sample_next must pick what draw(target_distribution) picks: ties, infinities,
    # NaN, other float types and a [1, vocab] row included
    logits = np.array([values] if row else values, dtype=dtype)
    expected = draw(target_distribution(logits, GenerationConfig()), make_rng(0))
    assert sample_next(logits, GenerationConfig(), make_rng(0)) == expected


@pytest.mark.parametrize("seed", range(5))
def test_top_k_one_equals_greedy(seed: int) -> None:
    logits = random_logits(seed)
    config = GenerationConfig(temperature=1.5, top_k=1)
    assert set(draws(logits, config, 20, seed=seed)) == {int(np.argmax(logits))}


def test_top_k_draws_only_from_the_k_best_and_uses_all_of_them() -> None:
    logits = np.array([0.0, 5.0, 4.9, 4.8, -1.0, 4.7], dtype=np.float32)
    seen = set(draws(logits, GenerationConfig(temperature=1.0, top_k=3), 400))
    assert seen == {1, 2, 3}


def test_tiny_top_p_keeps_only_the_most_likely_token() -> None:
    logits = random_logits(7, scale=0.5)  # flat: the nucleus fallback path runs
    config = GenerationConfig(temperature=1.0, top_p=1e-6)
    assert set(draws(logits, config, 30)) == {int(np.argmax(logits))}


def test_top_p_keeps_the_token_that_crosses_the_threshold() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    # mass before token 2 is 0.8 < 0.85, so token 2 stays; token 3 (mass before 0.95) goes
    seen = set(draws(logits, GenerationConfig(temperature=1.0, top_p=0.85), 600))
    assert seen == {0, 1, 2}


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs).astype(np.float32)
    # threshold 0.2 × 0.5 = 0.1: token 3 (0.05) is dropped, token 2 (0.15) stays
    seen = set(draws(logits, GenerationConfig(temperature=1.0, min_p=0.2), 600))
    assert seen == {0, 1, 2}


def test_lower_temperature_concentrates_on_the_argmax() -> None:
    logits = np.array([1.0, 0.5, 0.0, -0.5], dtype=np.float32)
    cold = draws(logits, GenerationConfig(temperature=0.2), 500).count(0)
    hot = draws(logits, GenerationConfig(temperature=5.0), 500).count(0)
    assert cold > 450
    assert hot < 250


def test_sampling_frequencies_follow_the_softmax() -> None:
    probs = np.array([0.6, 0.3, 0.1])
    logits = np.log(probs).astype(np.float32)
    counts = np.bincount(draws(logits, GenerationConfig(temperature=1.0), 5000), minlength=3)
    np.testing.assert_allclose(counts / 5000, probs, atol=0.03)


def test_penalties_match_the_ctrl_and_openai_formulas() -> None:
    logits = np.array([2.0, -1.0, 0.5, 3.0, 1.0], dtype=np.float32)
    config = GenerationConfig(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25
    )
    out = apply_penalties(logits, context_ids=[0, 0], generated_ids=[1, 1, 2], config=config)
    expected = np.array(
        [
            2.0 / 2,  # in the prompt: positive logit divided
            -1.0 * 2 - 0.5 - 0.25 * 2,  # generated twice: negative multiplied, then penalties
            0.5 / 2 - 0.5 - 0.25 * 1,  # generated once
            3.0,  # never seen
            1.0,
        ],
        dtype=np.float32,
    )
    np.testing.assert_allclose(out, expected, rtol=1e-6)
    assert out is not logits
    assert logits[0] == 2.0


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    logits = np.zeros(4, dtype=np.float32)
    config = GenerationConfig(presence_penalty=1.0, frequency_penalty=1.0)
    out = apply_penalties(logits, context_ids=[3, 3, 3], generated_ids=[], config=config)
    np.testing.assert_array_equal(out, logits)


def test_penalties_skip_ids_outside_the_logits() -> None:
    logits = np.ones(4, dtype=np.float32)
    config = GenerationConfig(repetition_penalty=2.0, frequency_penalty=1.0)
    out = apply_penalties(logits, context_ids=[99], generated_ids=[7, 1], config=config)
    np.testing.assert_allclose(out, [1.0, 0.5 - 1.0, 1.0, 1.0])


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = np.array([3.0, 2.0, 0.0], dtype=np.float32)
    config = GenerationConfig(repetition_penalty=2.0)
    assert sample_next(logits, config, make_rng(0), context_ids=[0]) == 1


def test_same_seed_gives_the_same_tokens_and_another_seed_differs() -> None:
    logits = random_logits(3, scale=1.0)
    config = GenerationConfig(temperature=1.0, top_p=0.95)
    assert draws(logits, config, 50, seed=11) == draws(logits, config, 50, seed=11)
    assert draws(logits, config, 50, seed=11) != draws(logits, config, 50, seed=12)


def test_allowed_mask_is_respected_by_greedy_and_sampling() -> None:
    logits = random_logits(5)
    allowed = np.zeros(VOCAB, dtype=bool)
    allowed[[10, 20, 30]] = True
    best_allowed = [10, 20, 30][int(np.argmax(logits[[10, 20, 30]]))]
    assert sample_next(logits, GenerationConfig(), make_rng(0), allowed=allowed) == best_allowed
    sampled = set(draws(logits, GenerationConfig(temperature=50.0), 200, allowed=allowed))
    assert sampled == {10, 20, 30}


def test_a_mask_that_allows_nothing_raises_constraint_error() -> None:
    with pytest.raises(ConstraintError, match="allows no next token"):
        sample_next(
            random_logits(0), GenerationConfig(), make_rng(0), allowed=np.zeros(VOCAB, bool)
        )


def test_a_mask_of_the_wrong_size_raises_constraint_error() -> None:
    with pytest.raises(ConstraintError, match="entries but the logits have"):
        sample_next(random_logits(0), GenerationConfig(), make_rng(0), allowed=np.ones(10, bool))


def test_all_allowed_tokens_at_minus_infinity_raise_instead_of_returning_garbage() -> None:
    logits = np.array([0.0, -np.inf, -np.inf], dtype=np.float32)
    allowed = np.array([False, True, True])
    with pytest.raises(ConstraintError, match="-inf"):
        sample_next(logits, GenerationConfig(temperature=1.0), make_rng(0), allowed=allowed)


def reference_kept(logits: np.ndarray, config: GenerationConfig, allowed: np.ndarray) -> dict:
    """Slow float64 reference of the filters: token → (rank, prob, mass before, max prob)."""
    ids = np.flatnonzero(allowed)
    order = ids[np.argsort(-logits[ids].astype(np.float64), kind="stable")]
    if 0 < config.top_k < order.size:
        order = order[: config.top_k]
    scaled = logits[order].astype(np.float64) / config.temperature
    probs = np.exp(scaled - scaled.max())
    probs /= probs.sum()
    before = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
    return {int(t): (i, probs[i], before[i], probs[0]) for i, t in enumerate(order)}


@settings(max_examples=150, deadline=None)
@given(
    vocab=st.integers(2, 60),
    seed=st.integers(0, 2**32 - 1),
    temperature=st.floats(0.05, 5.0),
    top_k=st.integers(0, 8),
    top_p=st.floats(0.01, 1.0),
    min_p=st.floats(0.0, 0.9),
)
def test_a_sampled_token_always_survives_every_filter(
    vocab: int, seed: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(vocab) * rng.uniform(0.1, 30)).astype(np.float32)
    allowed = rng.random(vocab) < 0.7
    allowed[rng.integers(vocab)] = True
    config = GenerationConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    token = sample_next(logits, config, make_rng(seed), allowed=allowed)
    kept = reference_kept(logits, config, allowed)
    assert token in kept  # allowed and within top-k (ties aside, by reference rank)
    _rank, prob, mass_before, top_prob = kept[token]
    assert prob > 0.0
    assert mass_before < top_p + 1e-4  # inside the nucleus
    assert prob >= min_p * top_prob * (1 - 1e-4)  # above the min-p floor


def test_log_softmax_matches_the_definition_and_is_stable() -> None:
    x = np.array([[1000.0, 1001.0, 999.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    out = log_softmax(x)
    assert out.dtype == np.float32
    expected = x - x.max(-1, keepdims=True)
    expected = expected - np.log(np.exp(expected).sum(-1, keepdims=True))
    np.testing.assert_allclose(out, expected, atol=1e-6)
    np.testing.assert_allclose(np.exp(out).sum(-1), 1.0, rtol=1e-6)


def test_log_softmax_keeps_minus_infinity_rows_free_of_nan() -> None:
    out = log_softmax(np.array([[-np.inf, -np.inf], [0.0, -np.inf]], dtype=np.float32))
    assert not np.isnan(out).any()
    assert out[1, 0] == 0.0 and out[1, 1] == -np.inf


def test_stop_string_split_across_deltas_is_cut_with_everything_after_it() -> None:
    matcher = StopStringMatcher(["</answer>"])
    assert matcher.feed("The result is 4</an") == ("The result is 4", False)
    assert matcher.feed("swer> and more") == ("", True)
    assert matcher.matched == "</answer>"
    assert matcher.feed("ignored") == ("", True)
    assert matcher.flush() == ""


def test_a_held_back_tail_is_released_when_it_turns_out_not_to_be_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("go ST") == ("go ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("S") == ("", False)
    assert matcher.flush() == "S"
    assert not matcher.stopped


def test_the_earliest_of_several_stop_strings_wins() -> None:
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo w"


def test_an_empty_stop_string_is_refused() -> None:
    with pytest.raises(UserError):
        StopStringMatcher(["ok", ""])


@settings(max_examples=200, deadline=None)
@given(
    text=st.text(alphabet="ab<>/ ", max_size=40),
    stops=st.lists(st.text(alphabet="ab<>/", min_size=1, max_size=4), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=8),
)
def test_streamed_output_equals_cutting_the_whole_text(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    matcher = StopStringMatcher(stops)
    emitted, stopped = "", False
    for start, end in zip(bounds, bounds[1:]):
        chunk, stopped = matcher.feed(text[start:end])
        emitted += chunk
    emitted += matcher.flush()
    # The stop string that completes first ends the text (ties: the one starting first).
    hits = sorted((text.find(s) + len(s), text.find(s)) for s in stops if s in text)
    expected = text[: hits[0][1]] if hits else text
    assert emitted == expected
    assert stopped == bool(hits)


# ---- token_logprobs ---------------------------------------------------------------------------


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p = x - log(sum(exp(x))) in float64: an independent reference."""
    x = logits.astype(np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_logprobs_are_the_raw_logits_log_softmax_and_the_top_k_sorted_most_likely_first(seed):
    logits = random_logits(seed)
    reference = reference_log_softmax(logits)
    sampled = sample_next(logits, GenerationConfig(temperature=0.8, top_p=0.9), make_rng(seed))
    logprob, top_ids, top_values = token_logprobs(logits, sampled, 5)
    assert logprob == pytest.approx(reference[sampled], abs=1e-5)
    np.testing.assert_allclose(top_values, reference[top_ids], atol=1e-5)
    np.testing.assert_array_equal(top_ids, np.argsort(-reference, kind="stable")[:5])
    assert np.all(np.diff(top_values) <= 0) and np.exp(top_values).sum() <= 1.0


def test_the_greedy_token_is_the_first_alternative_and_zero_alternatives_give_none():
    logits = random_logits(3)
    greedy = sample_next(logits, GenerationConfig(), make_rng(0))
    logprob, top_ids, top_values = token_logprobs(logits, greedy, 3)
    assert top_ids[0] == greedy and top_values[0] == logprob
    _, no_ids, no_values = token_logprobs(logits, greedy, 0)
    assert no_ids.size == 0 and no_values.size == 0
    all_ids = token_logprobs(logits[:4], 0, 20)[1]
    assert sorted(all_ids.tolist()) == [0, 1, 2, 3]  # top beyond the vocabulary: every token once


def test_token_logprobs_does_not_modify_the_logits():
    logits = random_logits(4)
    before = logits.copy()
    token_logprobs(logits, 1, 20)
    np.testing.assert_array_equal(logits, before)


def test_logprobs_are_refused_with_beam_search_and_past_twenty_alternatives():
    with pytest.raises(ValueError, match="num_beams=1"):
        GenerationConfig(num_beams=2, logprobs=1)
    with pytest.raises(ValueError, match="less than or equal to 20"):
        GenerationConfig(logprobs=21)
