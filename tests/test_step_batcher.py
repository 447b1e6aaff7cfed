"""StepBatcher: concurrent feeds share model steps, each caller gets its own row, errors reach
every caller of the failed step, and the caps on sequences and tokens hold (no model here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np
import pytest

from agentkv.engine.paged.model import SequenceStep
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.errors import UserError


class RecordingStep:
    """A fake model step: row i of the logits is ``[first id of sequence i, its length]``."""

    def __init__(self, seconds: float = 0.0, fail_on: int | None = None) -> None:
        self.seconds, self.fail_on = seconds, fail_on
        self.batches: list[list[int]] = []
        self.lock = threading.Lock()

    def __call__(self, sequences: Sequence[SequenceStep]) -> np.ndarray:
        with self.lock:
            self.batches.append([s.ids[0] for s in sequences])
        if self.fail_on is not None and any(s.ids[0] == self.fail_on for s in sequences):
            raise RuntimeError("the step failed")
        time.sleep(self.seconds)
        return np.array([[s.ids[0], len(s.ids)] for s in sequences], dtype=np.float32)


def feed_together(batcher: StepBatcher, sequences: list[SequenceStep]) -> list[object]:
    """Each sequence fed from its own thread, all released at once; results (or errors) in order."""
    results: list[object] = [None] * len(sequences)
    start = threading.Barrier(len(sequences))

    def worker(i: int) -> None:
        start.wait()
        try:
            results[i] = batcher.run(sequences[i], caller=i)
        except Exception as error:  # noqa: BLE001 - the test inspects it
            results[i] = error

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(sequences))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def seq(first: int, length: int = 1) -> SequenceStep:
    return SequenceStep(ids=[first] * length, past_len=0, blocks=[0])


def test_sequences_fed_at_the_same_time_share_steps_and_each_gets_its_own_row():
    step = RecordingStep(seconds=0.05)
    batcher = StepBatcher(step, max_batch=8)
    results = feed_together(batcher, [seq(i) for i in range(8)])
    assert [r.logits[0] for r in results] == list(range(8))  # type: ignore[attr-defined]
    stats = batcher.stats()
    assert stats.sequences == 8 and stats.steps < 8 and stats.largest_batch > 1
    assert sorted(i for batch in step.batches for i in batch) == list(range(8))
    # each caller learns the size of its step, and the steps are recorded one by one
    sizes = {i: len(batch) for batch in step.batches for i in batch}
    assert [r.batch_size for r in results] == [sizes[i] for i in range(8)]  # type: ignore[attr-defined]
    records = batcher.recent_steps()
    assert [r.sequences for r in records] == [len(batch) for batch in step.batches]
    assert sum(r.tokens for r in records) == 8 and all(r.seconds >= 0.05 and r.tokens_per_s > 0 for r in records)
    assert all(r.queued_s >= 0 for r in records)


def test_a_step_takes_at_most_max_batch_sequences_and_max_tokens_tokens_but_always_one():
    step = RecordingStep(seconds=0.02)
    batcher = StepBatcher(step, max_batch=3, max_tokens=10)
    feed_together(batcher, [seq(i, 4) for i in range(6)] + [seq(100, 50)])
    assert all(len(batch) <= 3 for batch in step.batches)
    for batch in step.batches:
        assert len(batch) == 1 or sum(50 if i == 100 else 4 for i in batch) <= 10
    assert [100] in step.batches  # longer than max_tokens: it runs, alone


def test_max_batch_one_runs_every_sequence_alone():
    step = RecordingStep(seconds=0.01)
    batcher = StepBatcher(step, max_batch=1)
    feed_together(batcher, [seq(i) for i in range(4)])
    assert all(len(batch) == 1 for batch in step.batches) and batcher.stats().steps == 4


def test_a_failed_step_raises_in_each_of_its_callers_and_later_steps_still_run():
    step = RecordingStep(seconds=0.02, fail_on=3)
    batcher = StepBatcher(step, max_batch=8)
    results = feed_together(batcher, [seq(i) for i in range(6)])
    failed = {i for i, r in enumerate(results) if isinstance(r, RuntimeError)}
    batch_of_3 = next(batch for batch in step.batches if 3 in batch)
    assert failed == set(batch_of_3)
    assert batcher.run(seq(9)).logits[0] == 9


def test_a_lone_caller_is_not_kept_waiting_for_company():
    batcher = StepBatcher(RecordingStep(seconds=0.01), max_batch=8, gather=500.0, max_gather_s=5.0)
    started = time.perf_counter()
    for i in range(3):
        assert batcher.run(seq(i)).logits[0] == i
    assert time.perf_counter() - started < 5.0  # the last step had one sequence: nobody to wait for
    assert batcher.stats().steps == 3


def test_a_leader_waits_for_the_callers_of_the_last_steps_to_come_back():
    step = RecordingStep(seconds=0.02)
    # NOTE: a wait of 10 steps (200 ms) for callers 5 ms apart: thread start-up on a loaded
    # machine must not decide the test (1 step, 20 ms, did once)
    batcher = StepBatcher(step, max_batch=4, gather=10.0, max_gather_s=1.0)
    feed_together(batcher, [seq(i) for i in range(4)])  # callers 0..3 stepped (in one or more steps)
    results: list[object] = []
    # they come back one by one, 5 ms apart (as sessions sampling their next token)
    threads = [threading.Timer(0.005 * i, lambda i=i: results.append(batcher.run(seq(10 + i), caller=i)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 4 and sorted(step.batches[-1]) == [10, 11, 12, 13]


def test_callers_that_stopped_feeding_are_waited_for_at_most_two_steps():
    step = RecordingStep(seconds=0.01)
    batcher = StepBatcher(step, max_batch=4, gather=1.0, max_gather_s=1.0)
    feed_together(batcher, [seq(i) for i in range(4)])
    for n in range(4):  # caller 0 goes on alone: the others finished
        batcher.run(seq(20 + n), caller=0)
    assert batcher.stats().largest_batch >= 2
    assert [len(batch) for batch in step.batches[-2:]] == [1, 1]


def test_a_caller_whose_call_ended_is_not_waited_for_nor_counted():
    # a wait of 5 s per step for a departed caller would be plain in the elapsed time
    batcher = StepBatcher(RecordingStep(seconds=0.01), max_batch=4, gather=500.0, max_gather_s=5.0)
    batcher.run(seq(1), caller="a")
    batcher.forget("a")
    assert batcher.load(caller="b").others == 0
    started = time.perf_counter()
    batcher.run(seq(2), caller="b")
    batcher.run(seq(3), caller="b")
    assert time.perf_counter() - started < 5.0


def test_a_leader_waiting_for_a_caller_stops_waiting_when_it_is_forgotten():
    batcher = StepBatcher(RecordingStep(seconds=0.01), max_batch=4, gather=5000.0, max_gather_s=30.0)
    batcher.run(seq(1), caller="a")
    timer = threading.Timer(0.2, batcher.forget, args=("a",))
    timer.start()
    started = time.perf_counter()
    batcher.run(seq(2), caller="b")  # gathers for "a" until it is forgotten, not for 30 s
    timer.join()
    assert time.perf_counter() - started < 15.0


def test_a_caller_queued_behind_a_step_is_told_how_long_it_waited():
    step = RecordingStep(seconds=0.2)
    batcher = StepBatcher(step, max_batch=1)
    results = feed_together(batcher, [seq(1), seq(2)])
    waits = sorted(r.queued_s for r in results)  # type: ignore[attr-defined]
    # the second waited for the first's step (less the moment it came later: threads start unevenly)
    assert waits[0] < 0.1 <= waits[1]
    assert batcher.stats().queued_s == pytest.approx(sum(waits))


def test_bad_caps_are_refused():
    with pytest.raises(UserError, match="max_batch"):
        StepBatcher(RecordingStep(), max_batch=0)
