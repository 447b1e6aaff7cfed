"""Drafting together pays while a step's tokens cost less of its time than drafts earn
(``engine/paged/draft_payoff.py``): the fit of step cost, the acceptance count, and the batcher
refusing drafts to many sessions that all draft when plain steps give more tokens per second."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.engine.decode.prompt_lookup import MAX_DRAFT, Drafts, PromptLookup
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.draft_payoff import PRIOR_TOKEN_COST, DraftPayoff, token_cost_ratio
from agentkv.engine.paged.model import SequenceStep

from test_draft_cap import ZeroStep


def steps_costing(c0: float, c1: float, tokens: list[int]) -> list[tuple[int, float]]:
    return [(t, c0 + c1 * t) for t in tokens]


def test_the_step_cost_is_fitted_to_recent_steps_and_falls_back_to_the_prior_without_spread():
    assert token_cost_ratio(steps_costing(0.008, 0.001, [1, 17, 2, 34, 4, 68, 8, 16])) == pytest.approx(0.125)
    assert token_cost_ratio(steps_costing(0.008, 0.001, [8] * 20)) == PRIOR_TOKEN_COST  # no slope to read
    assert token_cost_ratio([(1, 0.01)] * 3) == PRIOR_TOKEN_COST
    assert token_cost_ratio([(t, 0.02 - 0.0001 * t) for t in range(1, 40)]) == PRIOR_TOKEN_COST  # not a cost


@pytest.mark.parametrize(("acceptance", "sequences", "pays"), [
    (0.3, 1, True), (0.3, 2, True), (0.3, 4, False), (0.3, 16, False),  # quoting: c1/c0 = 0.125
    (0.9, 16, True), (0.05, 1, False),
])
def test_drafting_together_pays_while_acceptance_beats_the_share_of_step_time_tokens_cost(acceptance, sequences,
                                                                                          pays):
    payoff = DraftPayoff()
    payoff.note(drafted=100, accepted=round(100 * acceptance))
    payoff.refit(steps_costing(0.008, 0.001, [1, 17, 2, 34, 4, 68, 8, 16] * 4))
    # the rule: acceptance > N·c1 / (c0 + N·c1); N = 4 at c1/c0 = 1/8 is 1/3 > 0.3
    assert payoff.pays(sequences) is pays


def test_acceptance_decays_so_recent_drafts_weigh_most_and_nothing_known_means_try():
    payoff = DraftPayoff()
    payoff.refit([])
    assert payoff.acceptance is None and payoff.pays(sequences=16)
    for _ in range(200):
        payoff.note(drafted=16, accepted=16)
    for _ in range(200):
        payoff.note(drafted=16, accepted=0)
    assert payoff.acceptance is not None and payoff.acceptance < 0.05


def test_the_batcher_refuses_drafts_to_many_drafting_sessions_whose_drafts_are_mostly_refused():
    batcher = StepBatcher(ZeroStep(), max_batch=16)
    callers = [f"s{i}" for i in range(8)]
    for caller in callers:
        batcher.run(SequenceStep([1], 0, [0]), caller=caller)
        assert batcher.draft_cap(caller) == MAX_DRAFT  # drafters among drafters, nothing known yet
    for _ in range(30):
        batcher.note_draft(drafted=16, accepted=1)  # a confirmed share of 1/16
    assert batcher.draft_cap("s0") == 0  # 8 sessions: plain steps give more tokens per second
    for caller in callers[2:]:
        batcher.forget(caller)
    for _ in range(30):
        batcher.note_draft(drafted=16, accepted=8)
    assert batcher.draft_cap("s0") == MAX_DRAFT  # two sessions quoting well: drafting together pays


def test_a_draft_reports_its_outcome_when_it_ends():
    outcomes = []
    drafts = Drafts(PromptLookup([1, 2, 3, 4, 1, 2]), outcome=lambda d, a: outcomes.append((d, a)))
    draft = drafts.next_draft(left=2)
    assert draft == [3, 4]
    steps = drafts.verify([2], draft)
    next(steps)  # the verify's feed; the driver sends its rows of logits back
    with pytest.raises(StopIteration):
        steps.send(np.zeros((3, 8), np.float32))
    list(drafts.accept(3))
    assert outcomes == []  # the draft goes on
    list(drafts.accept(9))  # refused at its second token: it ends with 1 of 2 confirmed
    assert outcomes == [(2, 1)]
