"""Prefix hits, forks and beam rows as shared blocks on the paged engine: block accounting and
copy-on-write under any sequence of operations (hypothesis, over a fake paged model that checks every write), and
on the real model a hit that copies nothing and computes exactly what a cold prefill computes; the
pool only allocates or refuses, the paged backend makes room before a step."""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.block_pool import BlockPool, KVPoolExhausted
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.engine.paged.model import BLOCK_SIZE, SequenceStep
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.paged.shared_blocks import SharedBlocks
from agentkv.engine.session.session import SlotSession
from agentkv.testing import ScriptedTokenizer


class FakePagedModel:
    """A paged model whose "KV" at a position is the token id written there; every write
    asserts that no other block table holds the block written (copy-on-write)."""

    kv_cache_precision = "f32"

    def __init__(self, pool: BlockPool) -> None:
        import threading

        self.pool = pool
        self.lock = threading.RLock()
        self.keys = np.full((pool.num_blocks, 1, BLOCK_SIZE, 1), -1.0, dtype=np.float32)
        self.values = self.keys.copy()

    def step_alone(self, token, past_len, blocks, *, while_running=None):
        if while_running is not None:
            while_running()
        row = self.step([SequenceStep([token], past_len, blocks)])[0]
        return int(np.argmax(row)), row

    def step(self, sequences):
        for seq in sequences:
            for offset, token in enumerate(seq.ids):
                position = seq.past_len + offset
                block = seq.blocks[position // BLOCK_SIZE]
                assert self.pool.holders(block) == 1, f"wrote block {block} that {self.pool.holders(block)} tables hold"
                self.keys[block, 0, position % BLOCK_SIZE, 0] = token
                self.values[block, 0, position % BLOCK_SIZE, 0] = token
        return np.zeros((sum(seq.last_rows for seq in sequences), 8), dtype=np.float32)  # as PagedModel.step

    def copy_block(self, source: int, target: int) -> None:
        self.keys[target] = self.keys[source]
        self.values[target] = self.values[source]

    def cache_layers(self):
        return [(self.keys, self.values)]


class Session:
    """Just enough of a session for ``capture``: its tokens."""

    def __init__(self) -> None:
        self.tokens: tuple[int, ...] = ()
        self.shifted = False
        self.kv_exact = True


PREFIXES = [tuple(range(1000, 1000 + n)) for n in (20, 45, 70)]
OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["start_with_prefix", "feed", "trim", "capture", "reset", "squeeze", "fork",
                                    "beam"]),
              st.integers(0, 3), st.integers(0, 80)),
    min_size=1, max_size=25,
)


async def test_a_session_whose_kv_came_back_inexact_never_shares_its_blocks():
    pool = BlockPool(8)
    boundaries = PrefixBoundaries()
    boundaries.register(PREFIXES[0])
    cache = PagedPrefixCache(pool, boundaries=boundaries, max_blocks=None, block_bytes=1)
    slot = PagedSlot(FakePagedModel(pool), pool)  # type: ignore[arg-type]
    slot.feed(np.array([[*PREFIXES[0], 1]]), past_len=0)
    session = Session()
    session.tokens, session.kv_exact = (*PREFIXES[0], 1), False  # e.g. restored through a lossy snapshot
    assert await cache.capture(session, slot) == 0 and cache.lookup([*PREFIXES[0], 2]) is None
    session.kv_exact = True
    assert await cache.capture(session, slot) == len(PREFIXES[0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(operations=OPERATIONS)
def test_blocks_are_never_leaked_nor_written_while_shared_whatever_the_operations(operations):
    pool = BlockPool(24)
    model = FakePagedModel(pool)
    boundaries = PrefixBoundaries()
    for prefix in PREFIXES:
        boundaries.register(prefix)
    cache = PagedPrefixCache(pool, boundaries=boundaries, max_blocks=6, block_bytes=1)
    slots = [PagedSlot(model, pool) for _ in range(4)]  # type: ignore[arg-type]
    logs: list[list[int]] = [[] for _ in slots]
    sessions = [Session() for _ in slots]
    for name, which, amount in operations:
        slot, log = slots[which], logs[which]
        cache.reclaim(4)  # the caller makes room before a step; the pool itself never calls up
        try:
            if name == "start_with_prefix":
                prefix = PREFIXES[amount % len(PREFIXES)]
                hit = cache.lookup([*prefix, 1], longer_than=0)
                if hit is None:
                    slot.reset()
                    log.clear()
                    slot.feed(np.array([list(prefix)]), past_len=0)
                else:
                    try:
                        hit.write_into(slot)
                    finally:
                        hit.release()
                    log[:] = list(hit.tokens)
                    assert len(log) <= len(prefix)
                    if len(log) < len(prefix):
                        slot.feed(np.array([list(prefix[len(log):])]), past_len=len(log))
                log[:] = list(prefix)
            elif name == "feed":
                ids = list(range(2000 + len(log), 2000 + len(log) + 1 + amount % 40))
                slot.feed(np.array([ids]), past_len=len(log))
                log.extend(ids)
            elif name == "trim":
                slot.trim(min(amount, len(log)))
                del log[amount:]
            elif name == "capture":
                sessions[which].tokens = tuple(log)
                anyio.run(cache.capture, sessions[which], slot)
            elif name == "reset":
                slot.reset()
                log.clear()
            elif name == "fork":  # the next slot takes this one's KV by sharing its blocks
                other = (which + 1) % len(slots)
                pool.share(slot.blocks)
                SharedBlocks(pool, log, slot.blocks).write_into(slots[other])
                logs[other] = list(log)
            elif name == "beam":  # two steps of a beam search over 2–3 rows, then one row kept
                k = 2 + amount % 2
                slot.feed(np.array([[3000 + r] for r in range(k)]), len(log), np.array([0] * k))
                parents = [amount % k, (amount + 1) % k, 0][:k]
                slot.feed(np.array([[3100 + r] for r in range(k)]), len(log) + 1, np.array(parents))
                row = (amount // 3) % k
                slot.select_row(row, len(log) + 2)
                log.extend([3000 + parents[row], 3100 + row])
            elif name == "squeeze":  # another user of the pool takes what it can
                taken = pool.allocate(min(pool.free_blocks, amount % 8))
                pool.release(taken)
        except KVPoolExhausted:
            slot.reset()  # the session gives its KV up, as the engine would offload it
            log.clear()
        for s, held in zip(slots, logs):
            assert s.length() == len(held)
            if held:
                keys, _ = s.read()
                assert keys[0, 0, 0, :, 0].astype(int).tolist() == held
        for mark, blocks in cache.entries():
            stored = model.keys[list(blocks), 0].reshape(-1)[: len(mark)]
            assert stored.astype(int).tolist() == list(mark), "a cached prefix's KV changed"
        pool.check_integrity()
    for slot in slots:
        slot.reset()
    cache.clear()
    pool.check_integrity()
    assert pool.free_blocks == pool.num_blocks




def test_the_block_pool_only_allocates_or_refuses_and_never_calls_up():
    pool = BlockPool(4)
    assert not hasattr(pool, "reclaim")  # no hook back into the engine
    pool.allocate(3)
    with pytest.raises(KVPoolExhausted, match="after the engine made room"):
        pool.allocate(2)
    assert pool.free_blocks == 1


async def test_a_step_short_of_blocks_has_the_backend_make_room_first_then_the_pool_allocates():
    pool = BlockPool(4)  # 128 tokens
    model = FakePagedModel(pool)
    backend = PagedBackend(model, pool, slots=[PagedSlot(model, pool) for _ in range(3)],  # type: ignore[arg-type]
                           tokenizer=ScriptedTokenizer(), fingerprint="fake", eos_token_ids={0},
                           max_context_len=1000, kv_bytes_per_token=8)
    first, second = SlotSession(backend), SlotSession(backend)
    await first.prefill(list(range(100, 170)))  # 3 blocks
    assert backend.blocks_needed(None, 60) == 2 > pool.free_blocks
    await second.prefill(list(range(200, 260)))  # the idle first session went to host to make room
    assert backend.pool.offloads == 1 and first.held_kv is not None
    assert (await first.snapshot()).tokens == tuple(range(100, 170))
    await first.prefill(list(range(100, 171)))  # back into blocks: the second one makes room now
    assert first.tokens == tuple(range(100, 171)) and backend.pool.offloads == 2
    for session in (first, second):
        await session.check_integrity()
    with pytest.raises(KVPoolExhausted, match="kv_cache_bytes"):  # alone bigger than the pool
        await SlotSession(backend).prefill(list(range(300, 500)))
    await backend.close_sessions()
    pool.check_integrity()
    assert pool.free_blocks == pool.num_blocks
