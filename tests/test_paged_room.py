"""Room made before a step is the room the step gets: sessions that make room at the same time and
then allocate together (one batched step) each draw on the blocks reserved for them, with idle
sessions offloaded to make that room — no ``KVPoolExhausted``, no leaked block, every session's
tokens and KV right (over a fake paged model whose "KV" at a position is the token written there)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import anyio
import numpy as np

import agentkv.kv.log as kv_log

from agentkv.engine.base import GenerationConfig
from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.batcher import StepBatcher
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.model import BLOCK_SIZE, SequenceStep
from agentkv.engine.paged.shared_blocks import SharedBlocks
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.session.session import SlotSession
from agentkv.testing import ScriptedTokenizer

VOCAB = 400


def next_token(token: int) -> int:
    """What the fake model predicts after ``token``."""
    return 100 + (token * 7 + 3) % 200


class GatedPool(BlockPool):
    """A block pool whose allocations wait for each other while ``gate`` is set: sessions that
    made room one by one allocate together, as the sequences of one batched step do."""

    gate: threading.Barrier | None = None

    def allocate(self, n: int, holder: Hashable | None = None) -> list[int]:
        if self.gate is not None:
            self.gate.wait(timeout=10)
        return super().allocate(n, holder)


class FakePagedModel:
    """Writes each fed token as the KV of its position (asserting the block is not shared) and
    predicts ``next_token`` of the last one."""

    kv_cache_precision = "f32"

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.lock = threading.RLock()
        self.keys = np.full((pool.num_blocks, 1, BLOCK_SIZE, 1), -1.0, dtype=np.float32)
        self.values = self.keys.copy()

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        if while_running is not None:
            while_running()
        row = self.step([SequenceStep([token], past_len, blocks)])[0]
        return int(np.argmax(row)), row

    def step(self, sequences: list[SequenceStep]) -> np.ndarray:
        """Logits for each sequence's last ``last_rows`` positions, stacked (as ``PagedModel.step``)."""
        logits = np.zeros((sum(seq.last_rows for seq in sequences), VOCAB), dtype=np.float32)
        row = 0
        for seq in sequences:
            for offset, token in enumerate(seq.ids):
                position = seq.past_len + offset
                block = seq.blocks[position // BLOCK_SIZE]
                assert self.pool.holders(block) == 1
                self.keys[block, 0, position % BLOCK_SIZE, 0] = token
                self.values[block, 0, position % BLOCK_SIZE, 0] = token
            for token in seq.ids[len(seq.ids) - seq.last_rows:]:
                logits[row, next_token(token)] = 1.0
                row += 1
        return logits

    def copy_block(self, source: int, target: int) -> None:
        self.keys[target] = self.keys[source]
        self.values[target] = self.values[source]

    def cache_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(self.keys, self.values)]


def make_backend(pool: BlockPool, num_slots: int, *, batched: bool = False) -> PagedBackend:
    """``batched``: the slots feed through one ``StepBatcher``, kept as ``backend.test_batcher``."""
    model = FakePagedModel(pool)
    batcher = StepBatcher(model.step, max_batch=num_slots) if batched else None  # type: ignore[arg-type]
    backend = PagedBackend(model, pool, slots=[PagedSlot(model, pool, batcher) for _ in range(num_slots)],  # type: ignore[arg-type]
                           tokenizer=ScriptedTokenizer(), fingerprint="fake",
                           eos_token_ids={ScriptedTokenizer().eos_token_id},
                           max_context_len=4096, kv_bytes_per_token=8)
    backend.test_batcher = batcher  # type: ignore[attr-defined]
    return backend


async def assert_kv_is_tokens(session: SlotSession) -> None:
    snapshot = await session.snapshot()
    assert snapshot.tokens == session.tokens
    assert snapshot.to_float()[0][0, 0, 0, :, 0].astype(int).tolist() == list(session.tokens)


def assert_pool_empty(pool: BlockPool) -> None:
    pool.check_integrity()
    assert pool.free_blocks == pool.unreserved_blocks == pool.num_blocks


async def test_sessions_that_make_room_together_then_allocate_together_each_get_their_blocks():
    pool = GatedPool(8)  # 256 tokens
    backend = make_backend(pool, num_slots=3)
    first, second, idle = SlotSession(backend), SlotSession(backend), SlotSession(backend)
    await first.prefill(list(range(100, 164)))  # 2 blocks
    await second.prefill(list(range(200, 264)))  # 2 blocks
    await idle.prefill(list(range(300, 396)))  # 3 blocks: one block is left free
    assert pool.free_blocks == 1
    pool.gate = threading.Barrier(2)  # both make room, then both allocate
    async with anyio.create_task_group() as group:
        group.start_soon(first.prefill, list(range(100, 165)))  # each crosses into a new block
        group.start_soon(second.prefill, list(range(200, 265)))
    pool.gate = None
    assert backend.pool.offloads == 1 and idle.held_kv is not None  # the second made room by offloading
    assert pool.unreserved_blocks == pool.free_blocks  # each step used what it reserved
    assert first.tokens == tuple(range(100, 165)) and second.tokens == tuple(range(200, 265))
    for session in (first, second, idle):
        await assert_kv_is_tokens(session)
        await session.check_integrity()
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_sessions_decoding_together_on_a_pool_that_fits_them_only_without_the_idle_ones():
    pool = BlockPool(12)  # 384 tokens
    backend = make_backend(pool, num_slots=6, batched=True)
    idle = [SlotSession(backend) for _ in range(2)]
    for i, session in enumerate(idle):
        await session.prefill(list(range(100 + 100 * i, 196 + 100 * i)))  # 3 blocks each
    runners = [SlotSession(backend) for _ in range(4)]
    prompts = [[7 + i] * 20 for i in range(4)]
    for session, prompt in zip(runners, prompts):
        await session.prefill(prompt)  # 1 block each: 10 of 12 blocks held
    results: dict[int, tuple[int, ...]] = {}

    async def decode(i: int) -> None:
        result = await runners[i].generate(prompts[i], GenerationConfig(max_new_tokens=70))
        results[i] = result.token_ids

    async with anyio.create_task_group() as group:  # 90 tokens each: 3 blocks, 12 in all
        for i in range(4):
            group.start_soon(decode, i)
    for i, prompt in enumerate(prompts):
        expected = [next_token(prompt[-1])]
        while len(expected) < 70:
            expected.append(next_token(expected[-1]))
        assert results[i] == tuple(expected)
        assert runners[i].tokens == (*prompt, *expected[:-1])
    assert backend.pool.offloads >= 2 and all(s.held_kv is not None for s in idle)
    for session in (*runners, *idle):
        await assert_kv_is_tokens(session)
        await session.check_integrity()
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_room_reserved_for_a_step_that_never_ran_goes_back_when_the_slot_is_emptied():
    pool = BlockPool(4)
    backend = make_backend(pool, num_slots=1)
    session = SlotSession(backend)
    await session.prefill(list(range(100, 140)))  # 40 positions: 2 blocks
    async with backend.pool.lease(session) as slot:
        await backend.make_room(slot, 1)  # within block 1: nothing to take, nothing reserved
        assert pool.reserved(slot.table) == 0
        await backend.make_room(slot, 60)  # a step that would take 2 more blocks, then does not run
        assert pool.reserved(slot.table) == 2 and pool.unreserved_blocks == 0
    await SlotSession(backend).prefill(list(range(200, 210)))  # the one slot changes hands: emptied
    assert pool.reserved(slot.table) == 0 and session.held_kv is not None
    await backend.close_sessions()
    assert_pool_empty(pool)


class StrictPool(BlockPool):
    """A block pool that refuses any allocation nobody made room for: each must fit in what is
    reserved for its holder."""

    def allocate(self, n: int, holder: Hashable | None = None) -> list[int]:
        assert holder is not None and n <= self.reserved(holder), f"{n} blocks allocated without room made"
        return super().allocate(n, holder)


async def test_a_restore_over_kv_a_fork_shares_makes_room_for_all_of_its_blocks():
    pool = BlockPool(6)
    backend = make_backend(pool, num_slots=2)
    session = SlotSession(backend)
    await session.prefill(list(range(100, 228)))  # 4 blocks
    snapshot = await session.snapshot()
    fork = await session.fork()  # holds the same 4 blocks: the restore frees none of them
    assert pool.free_blocks == 2
    await session.restore(snapshot)  # 4 fresh blocks: the fork moves to host to make room
    assert session.tokens == snapshot.tokens and fork.held_kv is not None and not isinstance(fork.held_kv, SharedBlocks)
    for each in (session, fork):
        await assert_kv_is_tokens(each)
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_a_span_drop_over_kv_a_fork_shares_makes_room_for_the_rewritten_blocks(monkeypatch: Any):
    def cut_span(keys: np.ndarray, values: np.ndarray, start: int, end: int, convention: object
                 ) -> tuple[np.ndarray, np.ndarray]:  # no RoPE in the fake model: the span goes
        return np.delete(keys, range(start, end), axis=3), np.delete(values, range(start, end), axis=3)

    monkeypatch.setattr(kv_log, "drop_span", cut_span)
    pool = BlockPool(6)
    backend = make_backend(pool, num_slots=2)

    async def convention() -> object:
        return object()

    monkeypatch.setattr(backend, "rope_convention", convention)
    session = SlotSession(backend)
    await session.prefill(list(range(100, 228)))  # 4 blocks
    fork = await session.fork()
    await session.drop(0, 32)  # 96 positions: 3 fresh blocks, 2 free until the fork moves to host
    assert session.tokens == tuple(range(132, 228)) and fork.tokens == tuple(range(100, 228))
    for each in (session, fork):
        await assert_kv_is_tokens(each)
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_room_made_for_a_step_cancelled_before_it_ran_goes_back_at_once():
    pool = BlockPool(4)
    backend = make_backend(pool, num_slots=2)
    running, other = SlotSession(backend), SlotSession(backend)
    await running.prefill(list(range(100, 132)))  # 1 block
    make_room = backend.make_room
    with anyio.CancelScope() as scope:
        async def make_room_then_cancelled(slot: Any, tokens: int, *, rows: int = 1) -> None:
            await make_room(slot, tokens, rows=rows)  # 3 blocks set aside for the step ...
            scope.cancel()  # ... then the call is cancelled before its step starts
            await anyio.lowlevel.checkpoint()

        backend.make_room = make_room_then_cancelled  # type: ignore[method-assign]
        await running.prefill(list(range(100, 228)))
    backend.make_room = make_room  # type: ignore[method-assign]
    assert running.tokens == tuple(range(100, 132)) and pool.unreserved_blocks == pool.free_blocks == 3
    async with backend.pool.lease(running):  # it runs on: its blocks cannot be offloaded
        await other.prefill(list(range(500, 540)))  # 2 blocks of the 3 nobody holds
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_a_beam_search_makes_room_for_every_block_it_takes_its_final_collapse_included():
    pool = StrictPool(64)
    backend = make_backend(pool, num_slots=2)
    session = SlotSession(backend)
    prompt = list(range(100, 150))  # the collapse copies the winner's partly filled block
    await session.prefill(prompt)
    result = await session.generate(prompt, GenerationConfig(max_new_tokens=20, num_beams=3))
    assert len(result.token_ids) == 20 and session.tokens[: len(prompt)] == tuple(prompt)
    await assert_kv_is_tokens(session)
    await session.check_integrity()
    assert pool.unreserved_blocks == pool.free_blocks
    await backend.close_sessions()
    assert_pool_empty(pool)


async def test_a_session_whose_call_ended_is_no_longer_waited_for_by_the_step_batcher():
    backend = make_backend(BlockPool(16), num_slots=2, batched=True)
    batcher = backend.test_batcher  # type: ignore[attr-defined]
    first, second = SlotSession(backend), SlotSession(backend)
    await first.generate(list(range(100, 140)), GenerationConfig(max_new_tokens=4, prompt_lookup=False))
    # the step batcher waits for callers that stepped lately: a session between calls is not one
    assert batcher.stats().steps > 0 and batcher.load(caller=object()).others == 0
    await second.prefill(list(range(200, 240)))
    assert batcher.load(caller=object()).others == 0
    await backend.close_sessions()

