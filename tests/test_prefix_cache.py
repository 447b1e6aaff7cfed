"""PrefixCache: the radix tree on its own (fake KV, hypothesis) and on the real model (cache hit ≡ cold prefill)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.prefix.radix import PrefixCache
from agentkv.errors import UserError

FP = "test-model:kv=f32"
BYTES_PER_TOKEN = 16  # fake KV: keys + values [1, 1, 1, T, 2] float32


def fake_kv(tokens) -> tuple[np.ndarray, np.ndarray]:
    """K/V whose rows spell (token id, position): a lookup's KV shows which tokens it came from."""
    t = np.asarray(tokens, dtype=np.float32)
    keys = np.stack([t, np.arange(len(t), dtype=np.float32)], axis=-1)[None, None, None]
    return keys, -keys


def cache(budget=None, precision="f32") -> PrefixCache:
    return PrefixCache(fingerprint=FP, budget_bytes=budget, precision=precision)


def put(c: PrefixCache, tokens, salt: str = "") -> int:
    return c.insert(tokens, *fake_kv(tokens), salt=salt)


def assert_kv_of(hit, tokens) -> None:
    """``hit`` holds exactly the fake KV of ``tokens``."""
    assert hit is not None and hit.tokens == tuple(tokens)
    keys, values = hit.to_float()
    want_k, want_v = fake_kv(tokens)
    np.testing.assert_array_equal(keys, want_k)
    np.testing.assert_array_equal(values, want_v)


# ---- the tree on its own ------------------------------------------------------------------
def test_a_match_may_end_inside_an_edge_and_returns_the_prefix_of_its_kv():
    c = cache()
    put(c, [1, 2, 3, 4, 5, 6])
    assert_kv_of(c.lookup([1, 2, 3, 9, 9]), [1, 2, 3])
    assert c.stats().nodes == 1  # a lookup never splits


def test_a_diverging_insert_splits_the_edge_and_both_branches_keep_their_kv():
    c = cache()
    put(c, [1, 2, 3, 4, 5])
    assert put(c, [1, 2, 3, 7, 8]) == 2  # only the new suffix is stored
    assert c.stats().nodes == 3
    assert c.stats().bytes == 7 * BYTES_PER_TOKEN  # the shared [1, 2, 3] once
    assert_kv_of(c.lookup([1, 2, 3, 4, 5, 0]), [1, 2, 3, 4, 5])
    assert_kv_of(c.lookup([1, 2, 3, 7, 8, 0]), [1, 2, 3, 7, 8])
    assert_kv_of(c.lookup([1, 2, 3, 0]), [1, 2, 3])


def test_lookup_leaves_the_last_prompt_token_to_prefill():
    c = cache()
    put(c, [1, 2, 3, 4])
    assert_kv_of(c.lookup([1, 2, 3, 4]), [1, 2, 3])
    assert c.lookup([1]) is None


def test_lookup_returns_only_matches_longer_than_what_the_session_holds():
    c = cache()
    put(c, [1, 2, 3, 4])
    assert c.lookup([1, 2, 3, 4, 5], longer_than=4) is None
    assert_kv_of(c.lookup([1, 2, 3, 4, 5], longer_than=3), [1, 2, 3, 4])
    s = c.stats()
    assert (s.hits, s.misses, s.hit_tokens) == (1, 1, 1)


def test_inserting_a_cached_prefix_stores_nothing():
    c = cache()
    put(c, [1, 2, 3, 4])
    assert put(c, [1, 2]) == 0
    assert c.stats().inserted_tokens == 4


def test_salts_are_separate_namespaces():
    c = cache()
    put(c, [1, 2, 3], salt="tenant-a")
    assert c.lookup([1, 2, 3, 4]) is None
    assert c.lookup([1, 2, 3, 4], salt="tenant-b") is None
    assert_kv_of(c.lookup([1, 2, 3, 4], salt="tenant-a"), [1, 2, 3])
    assert c.lookup([1, 2, 3, 4], salt="tenant-a").fingerprint == FP


def test_lru_evicts_the_least_recently_used_leaf_and_keeps_the_most_recent():
    c = cache(budget=8 * BYTES_PER_TOKEN)
    put(c, [1, 1, 1, 1])
    put(c, [2, 2, 2, 2])
    assert c.lookup([1, 1, 1, 1, 0]) is not None  # [1...] is now more recent than [2...]
    put(c, [3, 3, 3, 3])
    assert (c.match_len([1, 1, 1, 1]), c.match_len([2, 2, 2, 2]), c.match_len([3, 3, 3, 3])) == (4, 0, 4)
    s = c.stats()
    assert s.bytes == 8 * BYTES_PER_TOKEN and s.evictions == 1 and s.evicted_bytes == 4 * BYTES_PER_TOKEN


def test_eviction_takes_leaves_first_so_a_shared_trunk_outlives_its_branches():
    c = cache(budget=7 * BYTES_PER_TOKEN)
    put(c, [5, 5, 5, 1])
    put(c, [5, 5, 5, 2])
    put(c, [9, 9, 9])  # needs 3 tokens: the two old leaves go, the trunk [5, 5, 5] stays
    assert c.match_len([5, 5, 5, 1]) == 3 and c.match_len([9, 9, 9]) == 3
    assert c.stats().bytes <= 7 * BYTES_PER_TOKEN


def test_an_entry_larger_than_the_budget_is_refused():
    c = cache(budget=3 * BYTES_PER_TOKEN)
    assert put(c, [1, 2, 3, 4]) == 0
    assert c.stats().bytes == 0 and c.match_len([1, 2, 3, 4]) == 0


def test_a_leased_prefix_is_not_evicted_until_released():
    c = cache(budget=4 * BYTES_PER_TOKEN)
    put(c, [1, 1, 1, 1])
    lease = c.acquire([1, 1, 1, 1, 0])
    assert lease.num_tokens == 4
    assert put(c, [2, 2, 2, 2]) == 0  # no room while [1...] is leased: refused, budget kept
    assert c.match_len([1, 1, 1, 1]) == 4
    assert_kv_of(lease.snapshot(), [1, 1, 1, 1])
    lease.release()
    lease.release()  # harmless
    assert put(c, [2, 2, 2, 2]) == 4
    assert c.match_len([1, 1, 1, 1]) == 0


def test_a_lease_survives_a_split_of_its_node():
    c = cache(budget=6 * BYTES_PER_TOKEN)
    put(c, [1, 2, 3, 4])
    with c.acquire([1, 2, 3, 4, 0]) as lease:
        put(c, [1, 2, 7])  # splits [1, 2 | 3, 4]; the lower half stays leased
        assert put(c, [8, 8, 8]) == 0
        assert_kv_of(lease.snapshot(), [1, 2, 3, 4])
    assert put(c, [8, 8, 8]) == 3


def test_misuse_raises_user_errors():
    with pytest.raises(UserError):
        cache(budget=-1)
    with pytest.raises(UserError):
        PrefixCache(fingerprint=FP, precision="f8")  # type: ignore[arg-type]
    with pytest.raises(UserError):
        cache().register([])
    with pytest.raises(UserError):
        cache().insert([1, 2], *fake_kv([1, 2, 3]))
    with pytest.raises(UserError):
        cache().acquire([1, 2]).snapshot()


@pytest.mark.parametrize(("precision", "tolerance"), [("f16", 5e-3), ("u8", 0.02)])
def test_lower_precisions_round_trip_within_their_quantisation_error(precision, tolerance):
    rng = np.random.default_rng(0)
    keys = rng.normal(size=(2, 1, 3, 10, 8)).astype(np.float32)
    c = cache(precision=precision)
    c.insert(range(10), keys, keys * 0.5)
    c.insert([0, 1, 2, 3, 99], keys[:, :, :, :5], keys[:, :, :, :5] * 0.5)  # forces a split
    got_k, got_v = c.lookup(list(range(10)) + [0]).to_float()
    assert np.abs(got_k - keys).max() <= tolerance
    assert np.abs(got_v - keys * 0.5).max() <= tolerance


sequences = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=10), min_size=1, max_size=12)


@settings(max_examples=150, deadline=None)
@given(inserted=sequences, probes=sequences)
def test_unbounded_lookup_matches_a_brute_force_longest_prefix(inserted, probes):
    c = cache()
    for seq in inserted:
        put(c, seq)
    assert c.stats().bytes == len({tuple(s[:i]) for s in inserted for i in range(1, len(s) + 1)}) * BYTES_PER_TOKEN
    for probe in probes:
        head = probe[:-1]
        best = max(next((i for i, (a, b) in enumerate(zip(s, head)) if a != b), min(len(s), len(head)))
                   for s in inserted)
        hit = c.lookup(probe)
        if best == 0:
            assert hit is None
        else:
            assert_kv_of(hit, probe[:best])


@settings(max_examples=150, deadline=None)
@given(inserted=sequences, budget_tokens=st.integers(0, 20))
def test_bounded_cache_never_exceeds_its_budget_and_keeps_the_newest_entry(inserted, budget_tokens):
    budget = budget_tokens * BYTES_PER_TOKEN
    c = cache(budget=budget)
    for seq in inserted:
        put(c, seq)
        assert c.stats().bytes <= budget
        if len(seq) <= budget_tokens:
            assert c.match_len(seq) == len(seq)
        for other in inserted:  # whatever is cached is the right KV
            n = c.match_len(other[:-1])
            hit = c.lookup(other)
            if n == 0:
                assert hit is None
            else:
                assert_kv_of(hit, other[:n])


def test_concurrent_inserts_and_lookups_keep_the_tree_consistent():
    c = cache(budget=60 * BYTES_PER_TOKEN)
    seqs = [[k % 5, (k * 7) % 5, k % 3, k % 2, k] for k in range(40)]
    errors: list[BaseException] = []

    def worker(offset: int) -> None:
        try:
            for k in range(offset, offset + 200):
                seq = seqs[k % len(seqs)]
                put(c, seq)
                hit = c.lookup(seq + [0])
                if hit is not None:
                    assert_kv_of(hit, seq[: hit.num_tokens])
        except BaseException as e:  # noqa: BLE001 — reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i * 13,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert c.stats().bytes <= 60 * BYTES_PER_TOKEN


class FakeSession:
    def __init__(self, tokens, shifted=False, kv_exact=True):
        self.tokens, self.shifted, self.kv_exact = tuple(tokens), shifted, kv_exact


class FakeSlot:
    def __init__(self, tokens):
        self.tokens, self.reads = list(tokens), 0

    def read(self):
        self.reads += 1
        return fake_kv(self.tokens)


async def test_capture_stores_registered_prefixes_the_session_covers_once():
    c = cache()
    c.register([1, 2, 3])
    c.register([1, 2, 3, 4, 5])
    c.register([7, 7])
    slot = FakeSlot([1, 2, 3, 4, 5, 6])
    assert await c.capture(FakeSession(slot.tokens), slot) == 5
    assert slot.reads == 1
    assert await c.capture(FakeSession(slot.tokens), slot) == 0
    assert slot.reads == 1  # nothing missing: the slot is not read again
    assert c.match_len([1, 2, 3, 4, 5, 6]) == 5 and c.stats().nodes == 2
    assert await c.capture(FakeSession([9, 9], shifted=True), FakeSlot([9, 9])) == 0


async def test_capture_never_shares_kv_that_came_back_from_a_lossy_restore():
    c = cache()
    c.register([9, 9, 9])
    assert await c.capture(FakeSession([9, 9, 9, 1], kv_exact=False), FakeSlot([9, 9, 9, 1])) == 0
    assert c.match_len([9, 9, 9]) == 0
    assert await c.capture(FakeSession([9, 9, 9, 1]), FakeSlot([9, 9, 9, 1])) == 3  # an exact one is shared


def test_a_lossy_entry_stays_lossy_when_an_insert_splits_it_and_a_lookup_joins_its_pieces():
    c = cache(precision="f16")
    tokens = [1, 2, 3, 4, 5]
    keys, values = fake_kv(tokens)
    c.insert(tokens, keys + 0.1, values + 0.1)  # 0.1 has no exact float16: the stored KV is rounded
    assert c.lookup([*tokens, 0]).lossless is False
    put(c, [1, 2, 3, 7, 8])  # splits the edge after [1, 2, 3]: two nodes now hold the lossy KV
    assert c.stats().nodes == 3
    assert c.lookup([1, 2, 0]).lossless is False  # a prefix of one piece
    assert c.lookup([*tokens, 0]).lossless is False  # two pieces joined
    assert c.lookup([1, 2, 3, 7, 8, 0]).lossless is False  # lossy piece + exact piece


