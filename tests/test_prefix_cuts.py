"""The prefix caches give back the cuts of the KV they hold: the radix cache across edge splits (unknown
where a path's KV was cut otherwise), the paged prefix cache for the blocks it shares."""

from __future__ import annotations

import numpy as np
from test_paged_prefix import FakePagedModel

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.prefix.radix import PrefixCache
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog


def kv_of(n: int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.arange(n, dtype=np.float32).reshape(1, 1, 1, n, 1)
    return keys, keys + 0.5


def test_the_radix_cache_gives_back_the_cuts_of_the_kv_it_holds_across_edge_splits():
    cache = PrefixCache(fingerprint="fp", budget_bytes=None)
    tokens = list(range(1, 21))
    cache.insert(tokens, *kv_of(20), cuts=[8, 12])
    cache.insert(tokens[:10] + [99] * 6, *kv_of(16), cuts=[8, 10])  # splits the edge at 10
    whole = cache.lookup([*tokens, 0])
    assert whole is not None and whole.cuts == (8, 12)
    branch = cache.lookup([*tokens[:10], *[99] * 6, 0])
    assert branch is not None and branch.cuts == (8, 10)
    assert cache.lookup(tokens[:11]).cuts == (8,)


def test_the_radix_cache_says_unknown_for_kv_computed_after_a_prefix_cut_otherwise():
    cache = PrefixCache(fingerprint="fp", budget_bytes=None)
    tokens = list(range(1, 21))
    cache.insert(tokens[:10], *kv_of(10), cuts=[4])
    cache.insert(tokens, *kv_of(20), cuts=[5, 10])  # its first 10 tokens' KV was cut at 5, not 4
    assert cache.lookup([*tokens[:10], 0]).cuts == (4,)
    assert cache.lookup([*tokens, 0]).cuts is None
    cache.insert(tokens[:10] + [7] * 5, *kv_of(15), cuts=[4, 10])  # the same cuts as the path: known
    assert cache.lookup([*tokens[:10], *[7] * 5, 0]).cuts == (4, 10)
    cache.insert([3, 3, 3], *kv_of(3))  # no cuts given: unknown
    assert cache.lookup([3, 3, 3, 0]).cuts is None


class CutSession:
    """Just enough of a session for ``capture``: its tokens and cuts."""

    def __init__(self, tokens, cuts) -> None:
        self.tokens, self.cuts, self.shifted, self.kv_exact = tuple(tokens), cuts, False, True


async def test_the_paged_prefix_cache_hands_out_the_cuts_of_the_blocks_it_shares():
    pool = BlockPool(8)
    boundaries = PrefixBoundaries()
    prefix = tuple(range(1000, 1040))
    boundaries.register(prefix)
    cache = PagedPrefixCache(pool, boundaries=boundaries, max_blocks=None, block_bytes=1)
    model = FakePagedModel(pool)
    slot, log = PagedSlot(model, pool), KVLog(boundaries=boundaries, chunk_size=32)
    log.feed(slot, [*prefix, 1, 2])
    assert log.cuts == [32, 40]
    assert await cache.capture(CutSession(log.tokens, log.cuts), slot) == len(prefix)
    hit = cache.lookup([*prefix, 5])
    assert hit is not None and hit.cuts == (32,)
    other, other_log = PagedSlot(model, pool), KVLog(boundaries=boundaries, chunk_size=32)
    other_log.load(other, hit, exact=True)
    other_log.feed(other, [5])
    assert other_log.cuts == [32, 40]
    cache.clear()
    for table in (slot, other):
        table.reset()
    assert pool.free_blocks == pool.num_blocks
