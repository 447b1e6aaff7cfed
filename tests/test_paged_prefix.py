"""Prefix hits, forks and beam rows as shared blocks on the paged engine: block accounting and
copy-on-write under any sequence of operations (hypothesis, over a fake paged model that checks every write), and
on the real model a hit that copies nothing and computes exactly what a cold prefill computes."""

from __future__ import annotations

import anyio
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.engine.paged.block_pool import BlockPool, KVPoolExhausted
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.engine.paged.model import BLOCK_SIZE
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.paged.shared_blocks import SharedBlocks


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

    def step(self, sequences):
        for seq in sequences:
            for offset, token in enumerate(seq.ids):
                position = seq.past_len + offset
                block = seq.blocks[position // BLOCK_SIZE]
                assert self.pool.holders(block) == 1, f"wrote block {block} that {self.pool.holders(block)} tables hold"
                self.keys[block, 0, position % BLOCK_SIZE, 0] = token
                self.values[block, 0, position % BLOCK_SIZE, 0] = token
        return np.zeros((len(sequences), 8), dtype=np.float32)

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
    pool.reclaim = cache.reclaim
    slots = [PagedSlot(model, pool) for _ in range(4)]  # type: ignore[arg-type]
    logs: list[list[int]] = [[] for _ in slots]
    sessions = [Session() for _ in slots]
    for name, which, amount in operations:
        slot, log = slots[which], logs[which]
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


