"""Drafts share steps with other sessions within a budget: a lone session drafts up to MAX_DRAFT,
a session sharing its steps drafts only as often as keeps the others' slowdown under 5 % (the
credit of ``draft_share.py``), sessions that all draft verify together in every step, and the
batcher reports the load it decides from (fake model step)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from agentkv.engine.decode.prompt_lookup import MAX_DRAFT, Drafts, PromptLookup
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.draft_share import DRAFT_COST, DRAFT_SHARE, MOST_DEBT, SLOWDOWN_TARGET, DraftShare
from agentkv.engine.paged.model import SequenceStep, logit_rows
from agentkv.engine.paged.slot import PagedSlot

VOCAB = 8


class ZeroStep:
    """A fake model step: zero logits for each sequence's last rows; remembers each step's sequences' sizes."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.steps: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, sequences: Sequence[SequenceStep]) -> np.ndarray:
        with self.lock:
            self.steps.append([len(s.ids) for s in sequences])
        time.sleep(self.seconds)
        return np.zeros((sum(logit_rows(sequences)), VOCAB), dtype=np.float32)


class FakeModel:
    """What a PagedSlot feeding through a batcher asks of its model: nothing but a lock."""

    lock = threading.RLock()


def slot_on(batcher: StepBatcher | None, pool: BlockPool) -> PagedSlot:
    model: Any = FakeModel()
    return PagedSlot(model, pool, batcher)


def test_a_lone_session_may_always_draft_the_most():
    share = DraftShare()
    for _ in range(50):
        assert share.cap(others=0) == MAX_DRAFT
        share.record(sequences=1, drafting=1, shared=False)  # alone: costs nobody anything
    assert share.credit == DRAFT_COST and share.shared_steps == 0


def test_a_draft_in_a_shared_step_waits_for_the_credit_to_build_up_again():
    share = DraftShare()
    assert share.cap(others=3) == MAX_DRAFT  # a whole draft's credit to begin with
    share.record(sequences=8, drafting=1, shared=True)
    refill = 0
    while share.cap(others=3) == 0:
        share.record(sequences=8, drafting=0, shared=True)
        refill += 1
    # the shared steps it takes to earn a draft back: its cost over the share of each step (the
    # drafted step earned its share too)
    assert abs(refill - (DRAFT_COST - DRAFT_SHARE) / DRAFT_SHARE) <= 1


def test_several_sessions_drafting_in_one_step_owe_it_before_the_next_draft():
    share = DraftShare()
    share.record(sequences=8, drafting=4, shared=True)
    assert share.credit < 0 and share.cap(others=7) == 0
    steps = 0
    while share.cap(others=7) == 0:
        share.record(sequences=8, drafting=0, shared=True)
        steps += 1
    assert steps >= round(4 * DRAFT_COST / DRAFT_SHARE) - 2


def test_drafts_debt_is_bounded_so_drafting_resumes_after_a_burst():
    share = DraftShare()
    for _ in range(50):  # e.g. sessions racing a caller that had not stepped lately
        share.record(sequences=8, drafting=8, shared=True)
    assert share.credit == -MOST_DEBT * DRAFT_COST
    steps = 0
    while share.cap(others=7) == 0:
        share.record(sequences=8, drafting=0, shared=True)
        steps += 1
    assert steps <= round((1 + MOST_DEBT) * DRAFT_COST / DRAFT_SHARE) + 1


def test_a_caller_waiting_for_the_running_step_counts_as_sharing_the_next():
    release = threading.Event()

    def gated(sequences: Sequence[SequenceStep]) -> np.ndarray:
        release.wait(timeout=10)
        return np.zeros((sum(logit_rows(sequences)), VOCAB), dtype=np.float32)

    batcher = StepBatcher(gated, max_batch=4)
    first = threading.Thread(target=batcher.run, args=(SequenceStep([1], 0, [0]),), kwargs={"caller": "a"})
    first.start()
    deadline = time.monotonic() + 5
    while not batcher._running and time.monotonic() < deadline:
        time.sleep(0.001)
    queued = threading.Thread(target=batcher.run, args=(SequenceStep([1], 0, [1]),), kwargs={"caller": "b"})
    queued.start()
    while not batcher._queue and time.monotonic() < deadline:
        time.sleep(0.001)
    try:  # neither a (running its first step) nor b (waiting) stepped lately; b shares c's next step
        assert batcher.load("c").others == 1
    finally:
        release.set()
        first.join()
        queued.join()


def test_sessions_drafting_whenever_allowed_slow_the_others_by_at_most_the_target():
    share = DraftShare()
    drafting_sessions = 4
    for _ in range(2000):
        drafting = sum(share.cap(others=7) > 0 for _ in range(drafting_sessions))  # all see the same credit
        share.record(sequences=8, drafting=drafting, shared=True)
    # others' slowdown (N + D(1 + c)) / (N + D) with the measured cost c per drafting sequence
    assert share.drafted_steps > 0
    slowdown = share.drafted_steps * drafting_sessions * DRAFT_COST / share.shared_steps
    assert slowdown <= SLOWDOWN_TARGET


def test_the_batcher_tells_a_caller_who_else_steps_and_its_draft_cap():
    step = ZeroStep(seconds=0.002)
    batcher = StepBatcher(step, max_batch=4)
    batcher.run(SequenceStep([1], 0, [0]), caller="a")
    assert batcher.load("a").others == 0 and batcher.load("a").draft_cap == MAX_DRAFT
    batcher.run(SequenceStep([1], 0, [1]), caller="b")
    load = batcher.load("a")
    assert load.others == 1 and load.draft_cap == MAX_DRAFT and load.draft_credit == DRAFT_COST
    # a draft verified while b steps too spends the credit: no draft for a while, for anyone
    batcher.run(SequenceStep([1, 2, 3], 0, [0], last_rows=3), caller="a")
    assert batcher.load("a").draft_cap == 0 and batcher.load("b").draft_cap == 0
    for _ in range(2):  # b goes on alone: after two steps nobody else steps with it
        batcher.run(SequenceStep([1], 0, [1]), caller="b")
    assert batcher.load("b").others == 0 and batcher.load("b").draft_cap == MAX_DRAFT


def test_a_slot_without_a_batcher_or_stepping_alone_drafts_the_most():
    pool = BlockPool(8)
    assert slot_on(None, pool).draft_cap() == MAX_DRAFT
    slot = slot_on(StepBatcher(ZeroStep()), pool)
    slot.feed(np.array([[1, 2, 3]]), past_len=0)
    assert slot.draft_cap() == MAX_DRAFT
    slot.feed_rows(np.array([[4] * 17]), past_len=3, rows=17)  # a draft of its own: nobody else waits
    assert slot.draft_cap() == MAX_DRAFT


def test_slots_sharing_steps_draft_as_often_as_the_budget_allows():
    pool = BlockPool(64)
    step = ZeroStep(seconds=0.001)
    batcher = StepBatcher(step, max_batch=4, gather=5.0, max_gather_s=0.05)
    drafter, other = slot_on(batcher, pool), slot_on(batcher, pool)
    rounds, drafts = 120, []
    start = threading.Barrier(2)

    def draft_loop() -> None:
        for _ in range(rounds):
            start.wait(timeout=10)
            cap, past = drafter.draft_cap(), drafter.length()
            if cap:
                drafter.feed_rows(np.array([[5] * (1 + cap)]), past_len=past, rows=1 + cap)
                drafter.trim(past + 1)  # the draft was refused: keep the one chosen token
            else:
                drafter.feed(np.array([[5]]), past_len=past)
            drafts.append(cap)

    def plain_loop() -> None:
        for _ in range(rounds):
            start.wait(timeout=10)
            other.feed(np.array([[6]]), past_len=other.length())

    threads = [threading.Thread(target=draft_loop), threading.Thread(target=plain_loop)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    drafted = sum(1 for cap in drafts if cap)
    assert drafts[0] == MAX_DRAFT  # the first draft rides on the starting credit
    # 120 shared steps earn 120 × DRAFT_SHARE drafts' worth, plus the credit they started with
    assert 2 <= drafted <= 1 + int(rounds * DRAFT_SHARE / DRAFT_COST) + 1
    assert drafted * DRAFT_COST / rounds <= SLOWDOWN_TARGET + DRAFT_COST / rounds


def test_each_step_record_says_when_it_ended_and_how_many_of_its_sequences_verified_a_draft():
    batcher = StepBatcher(ZeroStep())
    before = time.perf_counter()
    batcher.run(SequenceStep([1], 0, [0]), caller="a")
    batcher.run(SequenceStep([1, 2, 3], 1, [0], last_rows=3), caller="a")
    batcher.run(SequenceStep([1, 2, 3], 4, [0]), caller="a")  # a chunk of prompt: no draft
    records = batcher.recent_steps()
    assert [r.drafting for r in records] == [0, 1, 0]
    assert before <= records[0].ended_at <= records[1].ended_at <= records[2].ended_at <= time.perf_counter()


def test_steps_no_plain_session_waits_for_spend_no_credit():
    share = DraftShare()
    for _ in range(20):  # every session sharing the steps drafts: nobody plain waits for a verify
        share.record(sequences=4, drafting=4, shared=True, plain=False)
    assert share.credit == DRAFT_COST and share.drafted_steps == 20
    share.record(sequences=4, drafting=3, shared=True)  # a plain session waited this time
    assert share.credit < 0 and share.cap(others=3) == 0
    assert share.cap(others=3, plain=0) == MAX_DRAFT  # drafters among themselves need no credit


def test_sessions_that_all_draft_verify_their_drafts_in_every_shared_step():
    pool = BlockPool(64)
    batcher = StepBatcher(ZeroStep(seconds=0.001), max_batch=4, gather=5.0, max_gather_s=0.05)
    slots = [slot_on(batcher, pool) for _ in range(3)]
    rounds, caps = 40, {i: [] for i in range(3)}
    start = threading.Barrier(3)

    def draft_loop(i: int) -> None:
        slot = slots[i]
        for _ in range(rounds):
            start.wait(timeout=10)
            cap, past = slot.draft_cap(), slot.length()
            caps[i].append(cap)
            if cap:
                slot.feed_rows(np.array([[5] * (1 + cap)]), past_len=past, rows=1 + cap)
                slot.trim(past + 1)
            else:
                slot.feed(np.array([[5]]), past_len=past)

    threads = [threading.Thread(target=draft_loop, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(cap == MAX_DRAFT for i in range(3) for cap in caps[i])
    assert batcher.load(slots[0]).draft_credit == DRAFT_COST  # nobody plain waited: nothing spent
    assert sum(r.drafting for r in batcher.recent_steps()) == 3 * rounds


def test_a_plain_session_joining_drafting_ones_is_protected_by_the_credit_again():
    batcher = StepBatcher(ZeroStep(), max_batch=4)
    for caller in ("a", "b"):
        batcher.run(SequenceStep([1], 0, [0]), caller=caller)
        assert batcher.draft_cap(caller) == MAX_DRAFT
    batcher.run(SequenceStep([1, 2, 3], 1, [0], last_rows=3), caller="a")
    batcher.run(SequenceStep([1, 2, 3], 1, [0], last_rows=3), caller="b")
    assert batcher.load("a").draft_credit == DRAFT_COST  # a and b only: no plain session waited
    batcher.run(SequenceStep([7], 0, [1]), caller="plain")  # it never has a draft to feed
    batcher.run(SequenceStep([1, 2, 3], 4, [0], last_rows=3), caller="a")
    assert batcher.load("a").draft_credit < DRAFT_COST and batcher.draft_cap("b") == 0
    batcher.forget("plain")
    assert batcher.draft_cap("b") == MAX_DRAFT  # gone: the drafters again share only with drafters


def test_a_call_asks_for_its_draft_cap_only_when_it_has_a_draft_to_feed():
    asked = []

    def cap() -> int:
        asked.append(True)
        return MAX_DRAFT

    quoting = Drafts(PromptLookup([1, 2, 3, 4, 1, 2]), cap=cap)
    assert quoting.next_draft(left=100)[:2] == [3, 4] and asked == [True]
    free_text = Drafts(PromptLookup([1, 2, 3, 4, 5, 6]), cap=cap)
    assert free_text.next_draft(left=100) == [] and asked == [True]
