"""Tests of the hand-over that overlaps a run's first model step (issue 27): the threaded driver posts
the deltas made before a run from ``RunStep.started``, which a slot calls once, while the run's
first step computes; deltas are never lost or reordered, whether the run fails, the stream stops
or the step is batched. No model runs here: the bigram fakes of ``test_speculative_sampling`` and
``test_decode_runs``."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig, TokenDelta
from agentkv.engine.decode.model_steps import ModelStep, RunStep
from agentkv.engine.decode.sampling import greedy_pick
from agentkv.engine.decode.thread_channel import ThreadChannel
from agentkv.engine.decode.threaded import run_steps_in_thread
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import SequenceStep
from agentkv.engine.paged.slot import PagedSlot
from agentkv.kv.log import KVLog
from test_decode_runs import PROMPT, BigramLog, make_steps
from test_speculative_sampling import BigramPagedModel, counting_table


def never(token: int) -> bool:
    return False


class OrderedModel(BigramPagedModel):
    """Records each one-token step, and where ``while_running`` ran among them."""

    def __init__(self, pool: BlockPool, table: np.ndarray) -> None:
        super().__init__(pool, table)
        self.events: list[str] = []

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Any = None) -> tuple[int, np.ndarray]:
        self.events.append(f"start {token}")
        if while_running is not None:
            while_running()
        self.events.append(f"end {token}")
        return super().step_alone(token, past_len, blocks)


def test_a_run_alone_calls_started_once_while_its_first_step_computes() -> None:
    pool = BlockPool(4)
    model = OrderedModel(pool, counting_table())
    slot, log = PagedSlot(model, pool, StepBatcher(model.step)), KVLog()
    log.feed(slot, PROMPT)
    chosen = log.feed_run(slot, [3], steps=4, choose=greedy_pick, ends=never,
                          started=lambda: model.events.append("started"))
    assert chosen == [4, 5, 6, 7]
    assert model.events == ["start 3", "started", "end 3", "start 4", "end 4", "start 5", "end 5", "start 6", "end 6"]


def test_a_batched_run_calls_started_once_before_its_step() -> None:
    pool = BlockPool(4)
    model = OrderedModel(pool, counting_table())
    batcher = StepBatcher(model.step, max_gather_s=0.0)
    slot, log = PagedSlot(model, pool, batcher), KVLog()
    log.feed(slot, PROMPT)
    other = pool.allocate(1, holder="other")
    batcher.run(SequenceStep([1], 0, other), caller="other")  # another session stepped: no lease now
    calls: list[int] = []
    chosen = log.feed_run(slot, [3], steps=4, choose=greedy_pick, ends=never, started=lambda: calls.append(1))
    assert calls == [1] and chosen == [4] and model.events == []  # one ordinary batched step


def test_a_run_of_several_ids_calls_started_once_before_their_feed() -> None:
    pool = BlockPool(4)
    model = OrderedModel(pool, counting_table())
    slot, log = PagedSlot(model, pool, StepBatcher(model.step)), KVLog()
    log.feed(slot, PROMPT)
    chosen = log.feed_run(slot, [3, 4], steps=3, choose=greedy_pick, ends=never,
                          started=lambda: model.events.append("started"))
    assert chosen == [5, 6, 7]
    assert model.events == ["started", "start 5", "end 5", "start 6", "end 6"]


class FailingRunLog(BigramLog):
    """A log whose runs raise before their first step (``started`` is never called)."""

    def execute(self, step: ModelStep) -> Any:
        if isinstance(step, RunStep):
            raise RuntimeError("the run could not start")
        return super().execute(step)


async def test_a_run_that_fails_before_its_first_step_still_hands_over_the_deltas_before_it() -> None:
    log = FailingRunLog(counting_table(), PROMPT)
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=40, decode_run=8))
    got: list[int] = []
    with pytest.raises(RuntimeError, match="the run could not start"):
        async for event in run_steps_in_thread(steps, log.execute):
            assert isinstance(event, TokenDelta)
            got.append(event.token_id)
    assert got == [4]  # the first token, chosen from the prompt's logits before the first run


async def test_the_deltas_before_a_run_arrive_while_the_run_steps_and_in_order() -> None:
    log = BigramLog(counting_table(), PROMPT, step_s=0.02)  # a run of 8 takes ~0.16 s
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=24, decode_run=8))
    got: list[int] = []
    runs_done_at_first_delta: list[int] = []
    async for event in run_steps_in_thread(steps, log.execute):
        if isinstance(event, TokenDelta):
            if not got:
                runs_done_at_first_delta.append(len(log.runs))
            got.append(event.token_id)
    assert runs_done_at_first_delta == [0]  # handed over as the first run started, not after it
    assert got == [4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6]


async def test_a_stream_stopped_before_a_run_still_gets_no_delta_twice() -> None:
    log = BigramLog(counting_table(), PROMPT, step_s=0.005)
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=40, decode_run=4))
    seen: list[int] = []
    events = run_steps_in_thread(steps, log.execute)
    async for event in events:
        assert isinstance(event, TokenDelta)
        seen.append(event.token_id)
        if len(seen) == 6:
            break
    await events.aclose()
    assert seen == [4, 5, 6, 7, 1, 2]


async def test_wait_for_room_waits_while_the_lead_is_unreceived() -> None:
    channel: ThreadChannel[str] = ThreadChannel(lead=2)
    room = threading.Event()
    channel.post("a", size=2)
    waiter = threading.Thread(target=lambda: (channel.wait_for_room(), room.set()))
    waiter.start()
    await anyio.sleep(0.05)
    assert not room.is_set()
    assert await channel.receive() == "a"
    assert await anyio.to_thread.run_sync(room.wait, 5)
    waiter.join()
