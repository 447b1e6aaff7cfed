"""Tests of the hand-over that overlaps a run's first model step (issue 27): the threaded driver posts
the deltas made before a run from ``RunStep.started``, which a slot calls once, while the run's
first step computes; deltas are never lost or reordered, whether the run fails, the stream stops
or the step is batched. No model runs here: the bigram fakes of ``test_speculative_sampling`` and
``test_decode_runs``."""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.model_steps import ModelStep, RunStep
from agentkv.engine.decode.sampling import greedy_pick
from agentkv.engine.decode.threaded import run_steps_in_thread
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import SequenceStep, lock_calling_first
from agentkv.engine.paged.block_table import BlockTable
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.session import SlotSession
from agentkv.kv.log import KVLog
from test_decode_run_sessions import run_backend
from test_decode_runs import PROMPT, BigramLog, make_steps
from test_speculative_sampling import BigramPagedModel, counting_table


def never(token: int) -> bool:
    return False


class OrderedModel(BigramPagedModel):
    """Records each one-token step, and where ``while_running`` ran among them."""

    def __init__(self, pool: BlockPool, table: np.ndarray) -> None:
        super().__init__(pool, table)
        self.events: list[str] | None = None  # None: not recording (the prompt's feed)

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Any = None) -> tuple[int, np.ndarray]:
        assert self.events is not None
        self.events.append(f"start {token}")
        if while_running is not None:
            while_running()
        self.events.append(f"end {token}")
        row = BigramPagedModel.step(self, [SequenceStep([token], past_len, blocks)])[0]
        return int(np.argmax(row)), row

    def step(self, sequences: list[SequenceStep]) -> np.ndarray:
        if self.events is not None:
            self.events.append(f"step of {sum(len(s.ids) for s in sequences)}")
        return super().step(sequences)


def recording_slot() -> tuple[OrderedModel, PagedSlot, KVLog, list[str]]:
    """A batched slot over an ``OrderedModel`` that holds ``PROMPT``, and the events recorded from then on."""
    pool = BlockPool(4)
    model = OrderedModel(pool, counting_table())
    slot, log = PagedSlot(model, pool, StepBatcher(model.step, max_gather_s=0.0)), KVLog()
    log.feed(slot, PROMPT)
    model.events = events = []
    return model, slot, log, events


def test_a_run_alone_calls_started_once_while_its_first_step_computes() -> None:
    _, slot, log, events = recording_slot()
    chosen = log.feed_run(slot, [3], steps=4, choose=greedy_pick, ends=never, started=lambda: events.append("started"))
    assert chosen == [4, 5, 6, 7]
    assert events == ["start 3", "started", "end 3", "start 4", "end 4", "start 5", "end 5", "start 6", "end 6"]


def test_a_batched_run_calls_started_once_before_its_step() -> None:
    model, slot, log, events = recording_slot()
    assert slot.batcher is not None
    other = model.pool.allocate(1, holder="other")
    slot.batcher.run(SequenceStep([1], 0, other), caller="other")  # another session stepped: no lease now
    events.clear()
    chosen = log.feed_run(slot, [3], steps=4, choose=greedy_pick, ends=never, started=lambda: events.append("started"))
    assert chosen == [4] and events == ["started", "step of 1"]  # one ordinary batched step, after started


def test_a_run_of_several_ids_calls_started_once_before_their_feed() -> None:
    _, slot, log, events = recording_slot()
    chosen = log.feed_run(slot, [3, 4], steps=3, choose=greedy_pick, ends=never,
                          started=lambda: events.append("started"))
    assert chosen == [5, 6, 7]
    assert events == ["started", "step of 2", "start 5", "end 5", "start 6", "end 6"]


class RunCouldNotStart(Exception):
    """What ``FailingRunLog``'s runs raise."""


class FailingRunLog(BigramLog):
    """A log whose runs raise before their first step (``started`` is never called)."""

    def execute(self, step: ModelStep) -> Any:
        if isinstance(step, RunStep):
            raise RunCouldNotStart("the run could not start")
        return super().execute(step)


async def test_a_run_that_fails_before_its_first_step_still_hands_over_the_deltas_before_it() -> None:
    log = FailingRunLog(counting_table(), PROMPT)
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=40, decode_run=8))
    got: list[int] = []
    with pytest.raises(RunCouldNotStart):
        async for event in run_steps_in_thread(steps, log.execute):
            assert isinstance(event, TokenDelta)
            got.append(event.token_id)
    assert got == [4]  # the first token, chosen from the prompt's logits before the first run


class SlowStartLog(BigramLog):
    """A log whose runs take a while before their first step (a lease, room) and count their
    ``started`` calls."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started_calls = 0

    def execute(self, step: ModelStep) -> Any:
        if isinstance(step, RunStep) and step.started is not None:
            time.sleep(0.05)
            inner = step.started

            def started() -> None:
                self.started_calls += 1
                inner()

            step = replace(step, started=started)
        return super().execute(step)


async def test_the_deltas_before_a_run_go_over_when_it_starts_stepping_not_before_and_in_order() -> None:
    log = SlowStartLog(counting_table(), PROMPT, step_s=0.05)  # a run of 8 takes ~0.4 s
    steps, _ = make_steps(log, GenerationConfig(max_new_tokens=24, decode_run=8))
    got: list[int] = []
    at_arrival: list[tuple[int, int]] = []  # (runs started, runs done) as the hand-overs before runs 1, 2 came
    async for event in run_steps_in_thread(steps, log.execute):
        if isinstance(event, TokenDelta):
            if len(got) in (0, 1):
                at_arrival.append((log.started_calls, len(log.runs)))
            got.append(event.token_id)
    assert at_arrival == [(1, 0), (2, 1)]  # each after its run called started, long before that run ended
    assert got == [4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6, 7, 1, 2, 3, 4, 5, 6]


async def test_a_paged_session_hands_its_runs_a_started_that_the_first_step_calls() -> None:
    backend, model = run_backend(counting_table(), batched=True)
    first_steps: list[bool] = []
    plain = model.step_alone

    def step_alone(token: int, past_len: int, blocks: list[int], *, while_running: Any = None) -> Any:
        first_steps.append(while_running is not None)
        return plain(token, past_len, blocks, while_running=while_running)

    model.step_alone = step_alone  # type: ignore[method-assign]
    session = SlotSession(backend)
    result = await session.generate(PROMPT, GenerationConfig(max_new_tokens=24, decode_run=8, prompt_lookup=False))
    await session.close()
    assert len(result.token_ids) == 24
    assert first_steps[:8] == [True] + [False] * 7 and first_steps.count(True) >= 2  # each run's first step


async def test_deltas_go_over_before_a_run_waits_for_room_on_the_event_loop(monkeypatch) -> None:
    plain_took = BlockTable.try_grow
    monkeypatch.setattr(BlockTable, "try_grow", lambda table, tokens: tokens <= len(table.row) * 32 and
                        plain_took(table, tokens))  # no free block at a block's end: the next run makes room
    backend, _ = run_backend(counting_table(), batched=True)
    session = SlotSession(backend)
    received: list[int] = []
    in_make_room: list[tuple[int, int]] = []  # (deltas received, tokens chosen) while room is made
    plain_reserve, plain_make_room = backend._reserve, backend.make_room  # noqa: SLF001

    def reserve(holder: Any, needed: int) -> bool:  # a run after the first finds no free block
        if threading.current_thread().name == "agentkv-decode" and needed and not in_make_room and received:
            return False
        return plain_reserve(holder, needed)

    async def make_room(slot: Any, tokens: int, **kwargs: Any) -> Any:
        if not in_make_room and received:
            await anyio.sleep(0.05)  # the consumer takes what was handed over meanwhile
            in_make_room.append((len(received), slot.length() - len(PROMPT) + 1))  # the last chosen is not fed
        return await plain_make_room(slot, tokens, **kwargs)

    backend._reserve, backend.make_room = reserve, make_room  # type: ignore[method-assign]  # noqa: SLF001
    config = GenerationConfig(max_new_tokens=40, decode_run=8, prompt_lookup=False)
    async for delta in session.stream(PROMPT, config):
        received.append(delta.token_id)
    await session.close()
    assert len(received) == 40
    [(got, chosen)] = in_make_room
    assert got == chosen > 8  # every token chosen before the wait reached the consumer during it


def test_lock_calling_first_calls_first_only_when_another_thread_holds_the_lock() -> None:
    lock = threading.RLock()
    calls: list[str] = []
    assert lock_calling_first(lock, lambda: calls.append("first")) is not None and calls == []  # free: not called
    lock.release()
    taken, release = threading.Event(), threading.Event()

    def hold() -> None:
        with lock:
            taken.set()
            release.wait(5)

    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(5)
    threading.Timer(0.05, lambda: (calls.append("released"), release.set())).start()
    assert lock_calling_first(lock, lambda: calls.append("first")) is None
    lock.release()
    holder.join()
    assert calls == ["first", "released"]  # called before the wait, not after it
