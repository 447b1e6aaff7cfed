"""Tests of prompt-lookup drafts (``agentkv/engine/decode/prompt_lookup.py`` and the decode loop):
the proposer finds the latest earlier occurrence of the longest suffix, drafts keep two sizes and back
off, ``Drafts.lookahead`` pushes a run's token once and spends a back-off skip as a feed would, and
greedy decoding with drafts gives the very tokens, stream, stop and KV log of plain
decoding (grammar masks and forced runs included) in fewer feeds. A fake model stands in: its
logits depend on the last three tokens only, so the log's own n-grams predict it well. No model
runs here (the real-model tests are in ``tests/model/test_prompt_lookup_model.py``)."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.fast_forward import FastForwardCounts
from agentkv.engine.decode.prompt_lookup import (GOOD_DRAFT, MAX_BACKOFF, SMALL_DRAFT, DraftBudget, Drafts,
                                                 PromptLookup)
from agentkv.engine.decode.model_steps import FeedStep
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from _drive import DRIVERS, blocking_executor, drive
from _fake_grammars import NoZeroAndForcedPair

VOCAB = 12


def reference_proposal(tokens: list[int], limit: int, max_ngram: int, min_ngram: int) -> list[int]:
    """The proposer's rule written plainly: longest suffix first; its latest earlier occurrence
    followed by ``limit`` tokens, else its earliest."""
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == suffix]
        whole = [s for s in starts if s + n + limit <= len(tokens)]
        if starts:
            start = whole[-1] if whole else starts[0]
            return tokens[start + n:start + n + limit]
    return []


def test_propose_copies_what_followed_the_latest_earlier_occurrence_of_the_suffix_with_room_after_it():
    assert PromptLookup([1, 2, 3, 4, 1, 2]).propose(5) == [3, 4, 1, 2]
    assert PromptLookup([1, 2, 3, 4, 1, 2]).propose(2) == [3, 4]
    assert PromptLookup([7, 8, 1, 9, 7, 8, 2, 5, 7, 8]).propose(3) == [2, 5, 7]  # the later "7 8"
    assert PromptLookup([9, 4, 4, 4, 4, 4, 4]).propose(3) == [4, 4, 4]  # not the latest: one 4 after it
    assert PromptLookup([9, 4, 4, 4, 4, 4, 4]).propose(9) == [4, 4, 4]  # none has 9 after it: the earliest


def test_propose_prefers_the_longest_suffix_and_returns_nothing_below_min_ngram():
    # "5 6" occurred after 1 (-> 7) and after 4 (-> 8, later); the 3-gram "4 5 6" picks 8's side too,
    # but "1 5 6" only matches the first
    assert PromptLookup([1, 5, 6, 7, 4, 5, 6, 8, 1, 5, 6]).propose(1) == [7]
    assert PromptLookup([1, 2, 3, 4]).propose(4) == []  # no suffix occurred before
    assert PromptLookup([3, 9, 1, 3], min_ngram=2).propose(4) == []  # only a 1-gram matches
    assert PromptLookup([3, 9, 1, 3], min_ngram=1).propose(4) == [9, 1, 3]
    assert PromptLookup([1, 2, 1, 2]).propose(0) == []


def test_push_extends_the_searched_tokens_past_the_first_buffer():
    lookup = PromptLookup([1, 2, 3])
    for token in [4, 5] * 100:
        lookup.push(token)
    assert len(lookup) == 203 and lookup.propose(3) == [4, 5, 4]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), min_size=0, max_size=40), limit=st.integers(0, 9),
       ngrams=st.sampled_from([(3, 1), (3, 2), (2, 2), (4, 1)]))
def test_propose_equals_the_plain_rule(tokens, limit, ngrams):
    lookup = PromptLookup(tokens[:5], max_ngram=ngrams[0], min_ngram=ngrams[1])
    for token in tokens[5:]:
        lookup.push(token)
    assert lookup.propose(limit) == reference_proposal(tokens, limit, *ngrams)


def test_budget_drafts_its_size_while_drafts_go_well_its_small_size_after_one_that_did_not_and_backs_off():
    budget = DraftBudget(size=8, small=3)
    assert budget.take(left=100) == 8 and budget.take(left=2) == 2
    budget.update(8, GOOD_DRAFT)
    assert budget.take(left=100) == 8  # confirmed enough: the size stays (one verify shape)
    budget.update(8, GOOD_DRAFT - 1)
    assert budget.take(left=100) == 3  # a verify that yields 1-2 tokens costs more than it saves
    budget.update(3, 3)
    assert budget.take(left=100) == 8
    budget.update(1, 1)  # a draft cut short (max_new_tokens) confirmed whole goes well too
    assert budget.take(left=100) == 8
    skipped = []
    for _ in range(6):  # refused at once, again and again: the pause doubles up to MAX_BACKOFF
        budget.update(8, 0)
        skipped.append(budget.skip)
        while budget.take(left=100) == 0:
            pass
    assert skipped == [1, 2, 4, 8, 16, MAX_BACKOFF]
    budget.update(3, 1)
    assert budget.backoff == 1 and budget.skip == 0 and budget.take(left=100) == 3


def test_a_short_lookup_is_padded_to_the_drafts_size_by_repeating_what_it_found():
    drafts = Drafts(PromptLookup([1, 2, 3, 4, 5, 1, 2, 3]), DraftBudget(size=6))
    steps = drafts.feed([3], left=100)  # 3 was taken (the lookup has it) and is pending
    step = next(steps)
    # (1, 2, 3) was followed by 4 5 1 2 3, up to the log's end, where the log goes on with 4 ...
    assert step.ids == [3, 4, 5, 1, 2, 3, 4] and step.rows == 7
    with pytest.raises(StopIteration):
        steps.send(np.zeros((7, VOCAB), np.float32))
    assert drafts.ahead == [4, 5, 1, 2, 3, 4] and drafts.drafted == 6


class Markov:
    """A fake greedy model: logits for the next token depend on the last three tokens only."""

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def logits(self, tokens: list[int]) -> np.ndarray:
        key = tuple(tokens[-3:])
        rng = np.random.default_rng([self.seed, *[t + 1 for t in key]])
        return rng.normal(size=VOCAB).astype(np.float32)


class Counting(Markov):
    """A fake model that counts 1..11 and around again (what the prompt below shows it doing)."""

    def logits(self, tokens: list[int]) -> np.ndarray:
        scores = super().logits(tokens) * 0.1
        scores[tokens[-1] % (VOCAB - 1) + 1] = 5.0
        return scores


async def run(prompt: list[int], model: Markov, *, drafts_on: bool, max_new: int, stop_ids: frozenset[int],
              stop_strings: tuple[str, ...], grammar: bool, counts: FastForwardCounts | None = None,
              driver: str = "event-loop"):
    """Greedy decoding over a fake KV log through ``driver``; checks every choice reads the logits
    of exactly the tokens before it. Returns the deltas, the outcome, the log's tokens, the feeds,
    the drafts."""
    log = list(prompt)
    last: list[np.ndarray | None] = [model.logits(log)]
    feeds: list[list[int]] = []
    constraint = NoZeroAndForcedPair(VOCAB) if grammar else None

    def feed(ids: list[int]) -> None:
        feeds.append(list(ids))
        log.extend(ids)
        last[0] = model.logits(log)

    def feed_rows(ids: list[int], rows: int) -> np.ndarray:
        feeds.append(list(ids))
        out = []
        for i, token in enumerate(ids):
            log.append(token)
            if i >= len(ids) - rows:
                out.append(model.logits(log))
        last[0] = out[-1]
        return np.stack(out)

    def trim(keep: int) -> None:
        if len(log) > len(prompt) + keep:
            del log[len(prompt) + keep:]
            last[0] = None

    drafts = Drafts(PromptLookup(prompt)) if drafts_on else None

    def choose(generated: list[int]) -> int:
        logits = drafts.logits if drafts is not None and drafts.logits is not None else last[0]
        assert logits is not None
        np.testing.assert_array_equal(logits, model.logits([*prompt, *generated]))
        if constraint is not None:
            logits = np.where(constraint.allowed_mask(), logits, -np.inf)
        return int(np.argmax(logits))

    config = GenerationConfig(max_new_tokens=max_new, stop_strings=stop_strings)
    steps = TokenSteps(choose, config=config, decode_text=lambda ids: "".join(chr(97 + i) for i in ids),
                       stop_ids=stop_ids, max_new=max_new, constraint=constraint, forcing=constraint,
                       counts=counts if counts is not None else FastForwardCounts(), drafts=drafts)
    out = [event async for event in drive(steps, blocking_executor(feed, feed_rows, trim), driver)]
    deltas = [e for e in out if isinstance(e, TokenDelta)]
    outcome = out[-1]
    assert isinstance(outcome, DecodeOutcome)
    return deltas, outcome, log, feeds, drafts


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 10_000), prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=60),
       max_new=st.integers(0, 40), stop=st.sets(st.integers(0, VOCAB - 1), max_size=1),
       stop_strings=st.sampled_from([(), ("cd",), ("b", "ja")]), grammar=st.booleans(),
       drivers=st.tuples(st.sampled_from(DRIVERS), st.sampled_from(DRIVERS)))
def test_greedy_drafts_give_plain_decodings_tokens_stream_stop_and_log(seed, prompt, max_new, stop, stop_strings,
                                                                       grammar, drivers):
    # NOTE: plain and drafted decoding each through either driver (event loop or worker thread)
    model = Markov(seed)
    args = {"max_new": max_new, "stop_ids": frozenset(stop), "stop_strings": stop_strings, "grammar": grammar}
    plain = anyio.run(lambda: run(prompt, model, drafts_on=False, driver=drivers[0], **args))
    drafted = anyio.run(lambda: run(prompt, model, drafts_on=True, driver=drivers[1], **args))
    p_deltas, p_out, p_log, p_feeds, _ = plain
    d_deltas, d_out, d_log, d_feeds, drafts = drafted
    assert [(d.token_id, d.text) for d in d_deltas] == [(d.token_id, d.text) for d in p_deltas]
    assert (d_out.generated, d_out.text, d_out.finish_reason) == (p_out.generated, p_out.text, p_out.finish_reason)
    assert d_log == p_log  # the KV log holds what plain decoding fed: every token but the last
    assert len(d_feeds) <= len(p_feeds)
    assert 0 <= drafts.accepted <= drafts.drafted and not drafts.ahead


def test_a_repeating_answer_is_taken_in_fewer_feeds_and_the_counts_add_up():
    model = Counting(7)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] * 3
    args = {"max_new": 40, "stop_ids": frozenset(), "stop_strings": (), "grammar": False}
    _, p_out, _, p_feeds, _ = anyio.run(lambda: run(prompt, model, drafts_on=False, **args))
    _, d_out, _, d_feeds, drafts = anyio.run(lambda: run(prompt, model, drafts_on=True, **args))
    assert d_out.generated == p_out.generated
    assert drafts.accepted > 0 and len(d_feeds) <= len(p_feeds) - drafts.accepted + 1
    # every fed token stays in the log (all generated but the last) or was a drafted one trimmed
    # again: refused, past the end, or the accepted last token
    extra = sum(len(f) for f in d_feeds) - (len(p_out.generated) - 1) - (drafts.drafted - drafts.accepted)
    assert extra in (0, 1)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 10_000), max_new=st.integers(0, 40), grammar=st.booleans())
def test_steps_saved_are_the_feeds_one_by_one_decoding_runs_that_the_drafts_and_forced_runs_did_not(seed, max_new,
                                                                                                    grammar):
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11] * 2
    args = {"max_new": max_new, "stop_ids": frozenset(), "stop_strings": (), "grammar": grammar}
    counts = FastForwardCounts()
    _, out, _, feeds, drafts = anyio.run(lambda: run(prompt, Counting(seed), drafts_on=True, counts=counts, **args))
    # one-by-one: a feed per token but the last
    assert counts.steps_saved == max(0, len(out.generated) - 1) - len(feeds)
    if not grammar:  # every accepted drafted token is one, but one that ended the call
        assert counts.steps_saved in (drafts.accepted, drafts.accepted - 1)


@pytest.mark.parametrize("left", [0, -1])
def test_no_room_left_means_a_plain_feed(left):
    drafts = Drafts(PromptLookup([1, 2, 1, 2]))
    feed = drafts.feed([1], left)
    assert next(feed) == FeedStep([1])
    with pytest.raises(StopIteration):
        feed.send(None)
    assert drafts.logits is None and drafts.in_kv == 1


# ---- Drafts.lookahead ----------------------------------------------------------------------------

def accept(drafts: Drafts, token: int) -> bool:
    steps = drafts.accept(token)
    try:
        next(steps)
    except StopIteration as stop:
        return bool(stop.value)
    raise AssertionError("accept asked for a model step with no draft ahead")


def test_lookahead_pushes_a_token_once_and_says_when_a_draft_would_follow() -> None:
    drafts = Drafts(PromptLookup([1, 2, 3, 9, 8]))
    assert drafts.lookahead(7) is False  # "8 7" occurred nowhere
    assert len(drafts.lookup) == 6
    assert accept(drafts, 7) is False
    assert len(drafts.lookup) == 6  # accept did not push it again
    accept(drafts, 1)
    assert len(drafts.lookup) == 7
    assert drafts.lookahead(2) is True  # "1 2" occurred: a draft would follow (3, 9, 8, …)
    assert accept(drafts, 2) is False and len(drafts.lookup) == 8
    assert drafts.next_draft(3) == [3, 9, 8]


def test_lookahead_spends_a_back_off_skip_as_a_feed_would() -> None:
    drafts = Drafts(PromptLookup([1, 2, 3, 1]))
    drafts.budget.skip = 2
    assert drafts.lookahead(2) is False and drafts.budget.skip == 1  # "1 2" occurred, but this chance is skipped
    assert drafts.lookahead(3) is False and drafts.budget.skip == 0
    assert drafts.lookahead(1) is True  # "2 3 1" … occurred: no skip left
    assert len(drafts.lookup) == 7


def test_a_small_drafts_verify_fits_the_paged_models_small_step_graph():
    """A small draft and its pending token run on the small-step graph, so big and small verifies
    never re-prepare each other's graph (``engine/paged/graphs.py``)."""
    from agentkv.engine.paged.graphs import SMALL_STEP_TOKENS

    assert SMALL_DRAFT + 1 == SMALL_STEP_TOKENS
