"""Tests of the pieces a decode run is made of (issue 27): ``StepBatcher.alone`` lends the model only
to a caller stepping alone and hands it back to a caller that queues; ``PagedSlot.feed_run`` with
others stepping does one ordinary step, and a run handed back to others leaves the token's chance
to draft to the next feed; ``KVLog.feed_run`` over a slot without ``feed_run`` equals one feed per
token and a failure leaves the log at the slot's length. ``ThreadChannel``'s lead is tested in
``test_thread_channel.py``, ``Drafts.lookahead`` in ``test_prompt_lookup.py``, the loop with runs in
``test_decode_runs.py``. No model runs here: fakes over the bigram paged model."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import pytest

from agentkv.engine.decode.prompt_lookup import Drafts, PromptLookup
from agentkv.engine.decode.sampling import greedy_pick
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import SequenceStep
from agentkv.engine.paged.slot import PagedSlot
from agentkv.kv.log import KVLog
from test_decode_run_sessions import CountingBigramModel
from test_decode_runs import PROMPT, VOCAB
from test_speculative_sampling import counting_table


# ---- StepBatcher.alone ---------------------------------------------------------------------------

def zeros_step(sequences: Sequence[SequenceStep]) -> np.ndarray:
    return np.zeros((sum(s.last_rows for s in sequences), VOCAB), dtype=np.float32)


def one_token(past_len: int = 0) -> SequenceStep:
    return SequenceStep([1], past_len, [0])


def test_alone_is_refused_while_another_caller_stepped_in_the_last_two_steps() -> None:
    batcher = StepBatcher(zeros_step, max_gather_s=0.0)
    batcher.run(one_token(), caller="b")
    assert batcher.alone("a") is None  # b stepped in the last step
    batcher.run(one_token(), caller="a")
    assert batcher.alone("a") is None  # … and in the one before
    batcher.run(one_token(), caller="a")
    lease = batcher.alone("a")  # b's step is three steps back now
    assert lease is not None and not lease.others_waiting
    assert batcher.alone("c") is None  # the model is lent
    lease.close()
    assert batcher.alone("b") is None  # a stepped lately
    lease = batcher.alone("a")
    assert lease is not None
    lease.close()


def test_a_caller_queued_during_a_lease_is_seen_and_runs_right_after_close_and_the_lease_steps_count() -> None:
    batcher = StepBatcher(zeros_step, max_gather_s=0.0)
    lease = batcher.alone("a")
    assert lease is not None
    for _ in range(3):
        started = time.perf_counter()
        lease.counted(started)
    done = threading.Event()

    def other() -> None:
        batcher.run(one_token(), caller="b")
        done.set()

    thread = threading.Thread(target=other)
    thread.start()
    deadline = time.monotonic() + 5
    while not lease.others_waiting and time.monotonic() < deadline:
        time.sleep(0.001)
    assert lease.others_waiting
    assert batcher.alone("a") is None  # queued (and lent): nobody takes it again
    assert not done.wait(0.05)  # b waits for the model …
    lease.close()
    assert done.wait(5)  # … and gets it once it is handed back
    thread.join(5)
    stats = batcher.stats()
    assert (stats.steps, stats.sequences, stats.tokens) == (4, 4, 4)
    records = batcher.recent_steps()
    assert [(r.sequences, r.tokens) for r in records] == [(1, 1)] * 4
    assert all(r.queued_s == 0.0 for r in records[:3])
    assert batcher.alone("a") is None  # b stepped last


def test_a_second_close_of_a_lease_does_not_end_the_lease_held_after_it() -> None:
    batcher = StepBatcher(zeros_step, max_gather_s=0.0)
    first = batcher.alone("a")
    assert first is not None
    first.close()
    second = batcher.alone("a")
    assert second is not None
    first.close()  # stale
    assert batcher.alone("a") is None  # the model is still lent to the second lease
    second.close()
    assert batcher.alone("a") is not None


# ---- PagedSlot.feed_run --------------------------------------------------------------------------

def paged_pair(table: np.ndarray) -> tuple[StepBatcher, CountingBigramModel, PagedSlot, PagedSlot]:
    pool = BlockPool(8)
    model = CountingBigramModel(pool, table)
    batcher = StepBatcher(model.step, max_gather_s=0.001)
    return batcher, model, PagedSlot(model, pool, batcher), PagedSlot(model, pool, batcher)


def never(token: int) -> bool:
    return False


def test_feed_run_while_another_session_steps_does_one_ordinary_batched_step() -> None:
    batcher, model, a, b = paged_pair(counting_table())
    b.feed(np.array([[1, 2]]), 0)  # b steps: a may not take the model alone
    a.feed(np.array([[1, 2]]), 0)
    steps_before = batcher.stats().steps
    chosen: list[int] = []
    logits = a.feed_run(2, 2, steps=8, choose=greedy_pick, ends=never, chosen=chosen)
    assert chosen == [3] and a.length() == 3 and model.alone_steps == 0
    assert batcher.stats().steps == steps_before + 1
    assert np.array_equal(logits, counting_table()[2])
    batcher.forget(b)
    a.feed(np.array([[3]]), 3)  # two steps since b's: a steps alone now
    chosen = []
    a.feed_run(4, 4, steps=8, choose=greedy_pick, ends=never, chosen=chosen)
    assert chosen == [5, 6, 7, 1, 2, 3, 4, 5] and model.alone_steps == 8 and a.length() == 12


def test_feed_run_hands_the_model_back_after_the_step_during_which_another_session_queued() -> None:
    batcher, model, a, b = paged_pair(counting_table())
    b.feed(np.array([[1]]), 0)
    batcher.forget(b)
    a.feed(np.array([[1]]), 0)
    a.feed(np.array([[2]]), 1)
    done = threading.Event()

    def b_feeds() -> None:
        b.feed(np.array([[2]]), 1)
        done.set()

    thread = threading.Thread(target=b_feeds)
    calls = 0

    def choose(logits: np.ndarray) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:  # b queues during the run's third step
            thread.start()
            deadline = time.monotonic() + 5
            while batcher.load(a).others < 1 and time.monotonic() < deadline:
                time.sleep(0.001)
        return int(greedy_pick(logits))

    chosen: list[int] = []
    a.feed_run(3, 2, steps=8, choose=choose, ends=never, chosen=chosen)
    assert chosen == [4, 5, 6] and a.length() == 5
    assert done.wait(5)
    thread.join(5)
    assert b.length() == 2


def test_a_run_handed_back_to_a_queued_session_leaves_its_last_tokens_chance_to_draft_to_the_next_feed() -> None:
    batcher, _, a, b = paged_pair(counting_table())
    b.feed(np.array([[1]]), 0)
    batcher.forget(b)
    a.feed(np.array([[1, 2, 3, 4, 5, 6, 7, 1, 2]]), 0)
    a.feed(np.array([[3]]), 9)
    a.feed(np.array([[4]]), 10)
    drafts = Drafts(PromptLookup([1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4]))
    drafts.budget.skip = 3
    thread = threading.Thread(target=lambda: b.feed(np.array([[2]]), 1))

    def choose(logits: np.ndarray) -> int:  # b queues during the run's first step
        thread.start()
        deadline = time.monotonic() + 5
        while batcher.load(a).others < 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        return greedy_pick(logits)

    chosen: list[int] = []
    a.feed_run(5, 11, steps=8, choose=choose, ends=drafts.lookahead, chosen=chosen)
    thread.join(5)
    assert chosen == [6] and drafts.budget.skip == 3  # the run ended before asking ends about 6
    drafts.next_draft(10)  # the loop's next feed: 6's one chance to draft, as one by one
    assert drafts.budget.skip == 2


def test_a_run_that_needs_a_block_none_is_free_for_ends_there_and_leaves_room_making_to_the_next_feed() -> None:
    pool = BlockPool(2)
    model = CountingBigramModel(pool, counting_table())
    batcher = StepBatcher(model.step, max_gather_s=0.001)
    slot = PagedSlot(model, pool, batcher)
    slot.feed(np.array([[1, 2, 3, 4, 5, 6, 7] * 4 + [1, 2]]), 0)  # 30 tokens: block 0
    other = pool.allocate(1, holder="someone")  # the last free block
    chosen: list[int] = []
    slot.feed_run(3, 30, steps=8, choose=greedy_pick, ends=never, chosen=chosen)
    assert chosen == [4, 5] and slot.length() == 32  # positions 30, 31; position 32 needs a block
    assert slot.blocks == slot.blocks[:1] and pool.unreserved_blocks == 0
    pool.release(other)
    chosen = []
    slot.feed_run(5, 32, steps=3, choose=greedy_pick, ends=never, chosen=chosen)  # a free block again
    assert chosen == [6, 7, 1] and slot.length() == 35 and len(slot.blocks) == 2


async def test_a_run_reserves_no_room_beyond_its_first_step_so_a_session_beside_it_gets_the_free_block() -> None:
    from agentkv.engine.base import GenerationConfig
    from agentkv.engine.session.session import SlotSession
    from test_paged_room import make_backend, next_token

    pool = BlockPool(5)
    backend = make_backend(pool, num_slots=2, batched=True)
    model = backend.test_batcher._step.__self__  # type: ignore[attr-defined]
    plain_step, plain_alone = model.step, model.step_alone

    def slow_step(sequences: list[SequenceStep]) -> np.ndarray:
        time.sleep(0.03)
        return plain_step(sequences)

    def slow_alone(token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        time.sleep(0.03)
        return plain_alone(token, past_len, blocks, while_running=while_running)

    a, b = SlotSession(backend), SlotSession(backend)
    prompt_a, prompt_b = list(range(200, 260)), list(range(300, 364))  # 2 blocks each, b's full
    await a.prefill(prompt_a)
    await b.prefill(prompt_b)
    model.step, model.step_alone = slow_step, slow_alone
    backend.test_batcher._step = slow_step  # type: ignore[attr-defined]
    t1 = next_token(prompt_a[-1])
    stop = next_token(next_token(next_token(t1)))  # a writes 3 tokens, all inside its second block
    got: dict[str, tuple[int, ...]] = {}

    async def run_a() -> None:
        config = GenerationConfig(max_new_tokens=40, stop_token_ids=frozenset({stop}), prompt_lookup=False)
        got["a"] = (await a.generate(prompt_a, config)).token_ids

    async def run_b() -> None:
        await anyio.sleep(0.045)  # while a's run goes on
        got["b"] = (await b.generate([*prompt_b, 5], GenerationConfig(max_new_tokens=1))).token_ids

    async with anyio.create_task_group() as tg:
        tg.start_soon(run_a)
        tg.start_soon(run_b)
    assert len(got["a"]) == 4 and len(got["b"]) == 1  # one-by-one decoding's room: nobody ran out
    await backend.close_sessions()


# ---- KVLog.feed_run ------------------------------------------------------------------------------

class ListSlot:
    """A KV slot without ``feed_run``: its "KV" is the token list, its logits a bigram row."""

    def __init__(self, table: np.ndarray, *, fail_at: int | None = None) -> None:
        self.table, self.fail_at = table, fail_at
        self.kv: list[int] = []
        self.feeds = 0

    def feed(self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None,
             position_offset: int = 0) -> np.ndarray:
        assert past_len == len(self.kv)
        self.feeds += 1
        if self.feeds == self.fail_at:
            raise RuntimeError("the model step failed")
        self.kv.extend(int(t) for t in input_ids[0])
        return np.asarray(self.table[self.kv[-1]])[None]

    def length(self) -> int:
        return len(self.kv)

    def reset(self) -> None:
        self.kv = []

    def trim(self, n: int) -> None:
        del self.kv[n:]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        raise AssertionError("these tests never read or write a ListSlot's KV")

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        raise AssertionError("these tests never read or write a ListSlot's KV")

    def select_row(self, row: int, n: int) -> None:
        raise AssertionError("these tests never read or write a ListSlot's KV")


@pytest.mark.parametrize("ids", [[3], [3, 4]])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_kvlog_feed_run_on_a_slot_without_feed_run_equals_feeding_one_token_at_a_time(
        ids: list[int], steps: int) -> None:
    table = counting_table()
    slot, log = ListSlot(table), KVLog()
    log.feed(slot, PROMPT)
    chosen = log.feed_run(slot, ids, steps=steps, choose=greedy_pick, ends=never)
    one_slot, one_log = ListSlot(table), KVLog()
    one_log.feed(one_slot, PROMPT)
    logits, expected = one_log.feed(one_slot, ids), []
    while True:
        expected.append(greedy_pick(logits))
        if len(expected) == steps:
            break
        logits = one_log.feed(one_slot, expected[-1:])
    assert chosen == expected and log.tokens == one_log.tokens == slot.kv == one_slot.kv
    assert log.last_logits is not None and np.array_equal(log.last_logits, one_log.last_logits)


def test_kvlog_feed_run_stops_at_the_token_ends_accepts_and_does_not_feed_it() -> None:
    slot, log = ListSlot(counting_table()), KVLog()
    log.feed(slot, PROMPT)
    chosen = log.feed_run(slot, [3], steps=8, choose=greedy_pick, ends=lambda t: t == 6)
    assert chosen == [4, 5, 6] and log.tokens == slot.kv == [*PROMPT, 3, 4, 5]


@pytest.mark.parametrize("fail_at", [2, 3, 5])
def test_a_kvlog_feed_run_that_fails_midway_leaves_the_log_at_the_slots_length(fail_at: int) -> None:
    slot, log = ListSlot(counting_table(), fail_at=fail_at + 1), KVLog()  # the prompt is feed 1
    log.feed(slot, PROMPT)
    with pytest.raises(RuntimeError, match="the model step failed"):
        log.feed_run(slot, [3], steps=8, choose=greedy_pick, ends=never)
    assert len(log) == slot.length() and log.tokens == slot.kv == [*PROMPT, 3, 4, 5, 6][:len(PROMPT) + fail_at - 1]


class FailingAloneModel(CountingBigramModel):
    def __init__(self, pool: BlockPool, table: np.ndarray, fail_at: int) -> None:
        super().__init__(pool, table)
        self.fail_at = fail_at

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        if self.alone_steps + 1 == self.fail_at:
            raise RuntimeError("the model step failed")
        return super().step_alone(token, past_len, blocks, while_running=while_running)


@pytest.mark.parametrize("fail_at", [1, 2, 4])
def test_a_paged_feed_run_that_fails_midway_leaves_the_log_at_the_slots_length_and_no_logits(fail_at: int) -> None:
    pool = BlockPool(4)
    model = FailingAloneModel(pool, counting_table(), fail_at)
    slot, log = PagedSlot(model, pool), KVLog()
    log.feed(slot, PROMPT)
    with pytest.raises(RuntimeError, match="the model step failed"):
        log.feed_run(slot, [3], steps=8, choose=greedy_pick, ends=never)
    assert len(log) == slot.length() == len(PROMPT) + fail_at - 1
    assert log.tokens == [*PROMPT, 3, 4, 5, 6][:len(PROMPT) + fail_at - 1]
    if fail_at > 1:
        assert log.last_logits is None
