"""Tests of the token loop run in one worker thread (``agentkv/engine/decode/threaded.py``): its
steps run off the event loop in one thread, a closed, cancelled or failed stream leaves
one-by-one decoding's log (also when the thread ran ahead of its consumer), a failing settle
never hides the first error, and a paged session that runs out of blocks mid-decode makes room
through the event loop (an idle session goes to host) and both sessions keep exact KV. No model
runs here: fake steps, and the fake bigram paged model of ``test_speculative_sampling``."""

from __future__ import annotations

import contextvars
import logging
import threading
import time

import anyio
import numpy as np
import pytest
import sniffio

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.model_steps import FeedStep, ModelStep, TrimStep
from agentkv.engine.decode.threaded import DELTAS_AHEAD, run_steps_in_thread
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import BLOCK_SIZE
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.session import SlotSession
from agentkv.testing import ScriptedTokenizer
from test_speculative_sampling import BigramPagedModel, assert_kv_is_tokens, counting_table

PROMPT = [1, 2, 3]
REQUEST = contextvars.ContextVar("REQUEST", default="none")


class FakeLog:
    """Generated tokens fed (the prompt is implied), every step's thread, and an optional fault."""

    def __init__(self, *, step_s: float = 0.0, fail_at: int | None = None, fail_trim: bool = False) -> None:
        self.tokens: list[int] = []
        self.threads: set[str] = set()
        self.contexts: set[str] = set()
        self.libraries: set[str | None] = set()
        self.step_s, self.fail_at, self.fail_trim = step_s, fail_at, fail_trim
        self.feeds = self.longest = 0

    def execute(self, step: ModelStep) -> None:
        self.threads.add(threading.current_thread().name)
        self.contexts.add(REQUEST.get())
        try:
            self.libraries.add(sniffio.current_async_library())
        except sniffio.AsyncLibraryNotFoundError:
            self.libraries.add(None)
        if isinstance(step, TrimStep):
            if self.fail_trim:
                raise RuntimeError("trim failed")
            del self.tokens[step.keep:]
            return
        assert isinstance(step, FeedStep)
        self.feeds += 1
        if self.fail_at is not None and self.feeds == self.fail_at:
            self.tokens.extend(step.ids[:1])  # a step that failed after its first chunk
            raise ValueError("the model step failed")
        time.sleep(self.step_s)
        self.tokens.extend(step.ids)
        self.longest = max(self.longest, len(self.tokens))


def counting_steps(max_new: int = 20) -> TokenSteps:
    return TokenSteps(lambda generated: 10 + len(generated), config=GenerationConfig(max_new_tokens=max_new),
                      decode_text=lambda ids: "".join(f"<{i}>" for i in ids), stop_ids=frozenset(), max_new=max_new)


async def test_every_step_runs_in_one_decode_thread_with_the_callers_context_while_the_loop_stays_free():
    log = FakeLog(step_s=0.01)
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await anyio.sleep(0.002)

    REQUEST.set("call-7")
    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        events = [e async for e in run_steps_in_thread(counting_steps(), log.execute)]
        tg.cancel_scope.cancel()
    assert isinstance(events[-1], DecodeOutcome) and events[-1].generated == list(range(10, 30))
    assert log.tokens == list(range(10, 29))  # every generated token but the last
    assert log.threads == {"agentkv-decode"}  # its own thread, not one of anyio's workers
    assert log.contexts == {"call-7"}
    assert log.libraries == {None}  # no event loop in that thread (sniffio, as in anyio's workers)
    assert ticks >= 19 * 0.01 / 0.002 / 4  # the event loop kept running through 19 steps of 10 ms


@pytest.mark.parametrize("k", [1, 2, 7])
async def test_a_consumer_that_stops_early_leaves_the_log_of_its_last_delta_even_when_the_thread_ran_ahead(k):
    log = FakeLog()  # instant steps: the thread runs ahead of the consumer
    events = run_steps_in_thread(counting_steps(), log.execute)
    taken = []
    async for event in events:
        assert isinstance(event, TokenDelta)
        taken.append(event.token_id)
        if len(taken) == k:
            await anyio.sleep(0.05)  # the thread runs as far ahead as it may meanwhile
            break
    await events.aclose()
    assert log.longest > len(taken) - 1  # it did run ahead
    assert taken == list(range(10, 10 + k)) and log.tokens == taken[:-1]


async def test_a_paused_consumer_holds_the_thread_a_bounded_number_of_deltas_ahead():
    log = FakeLog()
    events = run_steps_in_thread(counting_steps(max_new=100), log.execute)
    first = await events.__anext__()
    assert isinstance(first, TokenDelta)
    await anyio.sleep(0.2)  # paused: the thread stops once DELTAS_AHEAD deltas wait
    assert DELTAS_AHEAD - 1 <= log.feeds <= DELTAS_AHEAD + 1
    await events.aclose()
    assert log.tokens == []


async def test_a_cancel_lands_at_once_even_when_deltas_are_queued():
    log = FakeLog()
    taken: list[int] = []
    with anyio.CancelScope() as scope:
        async for event in run_steps_in_thread(counting_steps(max_new=100), log.execute):
            assert isinstance(event, TokenDelta)
            taken.append(event.token_id)
            if len(taken) == 3:
                await anyio.sleep(0.05)  # deltas queue up meanwhile
                scope.cancel()
    assert scope.cancelled_caught and len(taken) == 3
    assert log.tokens == taken[:-1]


async def test_a_cancelled_consumer_returns_after_the_step_in_flight_and_leaves_a_settled_log():
    log = FakeLog(step_s=0.05)
    taken: list[int] = []
    with anyio.CancelScope() as scope:
        async for event in run_steps_in_thread(counting_steps(), log.execute):
            assert isinstance(event, TokenDelta)
            taken.append(event.token_id)
            if len(taken) == 3:
                scope.cancel()
    assert scope.cancelled_caught
    assert log.tokens == taken[:-1]
    fed = log.feeds
    await anyio.sleep(0.15)
    assert log.feeds == fed  # the thread stopped


async def test_a_failing_step_raises_its_own_error_and_the_log_keeps_what_was_fed_before_it():
    log = FakeLog(fail_at=4)
    taken = []
    with pytest.raises(ValueError, match="the model step failed"):
        async for event in run_steps_in_thread(counting_steps(), log.execute):
            taken.append(event)
    assert log.tokens == list(range(10, 13))  # the failed step's first chunk was trimmed again


async def test_a_step_that_fails_after_the_consumer_left_is_logged_and_the_log_is_the_consumers(caplog):
    log = FakeLog(fail_at=5)
    events = run_steps_in_thread(counting_steps(), log.execute)
    taken = []
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.decode.threaded"):
        async for event in events:
            taken.append(event.token_id)
            if len(taken) == 3:
                await anyio.sleep(0.05)  # the thread reaches the failing step meanwhile
                break
        await events.aclose()
    assert log.feeds == 5 and log.tokens == taken[:-1]
    assert "failed after the stream's consumer had left" in caplog.text


async def test_a_settle_that_fails_after_a_failed_step_is_logged_and_the_first_error_goes_on(caplog):
    log = FakeLog(fail_at=2, fail_trim=True)
    with caplog.at_level(logging.ERROR, logger="agentkv.engine.decode.threaded"):
        with pytest.raises(ValueError, match="the model step failed"):
            async for _ in run_steps_in_thread(counting_steps(), log.execute):
                pass
    assert "settling the KV log" in caplog.text and "trim failed" in caplog.text


def paged_backend(num_blocks: int) -> PagedBackend:
    pool = BlockPool(num_blocks)
    model = BigramPagedModel(pool, counting_table())
    return PagedBackend(model, pool, slots=[PagedSlot(model, pool), PagedSlot(model, pool)],  # type: ignore[arg-type]
                        tokenizer=ScriptedTokenizer(), fingerprint="bigram",
                        eos_token_ids={ScriptedTokenizer().eos_token_id}, max_context_len=4096, kv_bytes_per_token=8)


async def test_a_decode_that_runs_out_of_blocks_offloads_an_idle_session_through_the_event_loop():
    backend = paged_backend(num_blocks=4)
    idle, busy = SlotSession(backend), SlotSession(backend)
    idle_prompt = [1, 2, 3, 4, 5, 6, 7] * 9  # 63 tokens: two blocks
    await idle.prefill(idle_prompt)
    assert backend.block_pool.unreserved_blocks == 2
    config = GenerationConfig(max_new_tokens=3 * BLOCK_SIZE, ignore_eos=True, prompt_lookup=False)
    result = await busy.generate(PROMPT, config)  # needs three blocks: the idle session's must go
    assert len(result.token_ids) == 3 * BLOCK_SIZE
    assert idle.held_kv is not None  # offloaded to host while the other decoded
    await assert_kv_is_tokens(busy)
    again = await idle.generate(idle_prompt, GenerationConfig(max_new_tokens=4, prompt_lookup=False))
    # came back from host, not re-prefilled (a fully covered prompt still feeds its last token)
    assert (again.metrics.restored_tokens, again.metrics.prefilled_tokens) == (len(idle_prompt) - 1, 1)
    await assert_kv_is_tokens(idle)
    assert np.array_equal(np.array(idle.tokens[:len(idle_prompt)]), np.array(idle_prompt))
