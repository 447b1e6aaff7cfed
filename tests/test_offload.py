"""The offload store without a model: idle sessions' KV as keyed blocks in the KV store's tiers.

An offload writes only the blocks no tier holds (a shared prompt, a history a save wrote), tenants
share nothing, a lost block costs the re-prefill of what follows it, shifted KV stays private to
its receipt, and the engine's own tiers keep no block once no receipt needs it. The real-model
paths (eight sessions on two slots, spill and drop, corrupt blocks) are in
``tests/model/test_offload_model.py``.
"""

from __future__ import annotations

from datetime import timedelta

import numpy as np
import pytest

from agentkv.engine.session.offload_store import OffloadStore
from agentkv.errors import UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kvstore.block_store import BlockStore
from agentkv.kvstore.block_tiers import HostBlocks


def namespace_for(*, salt: str = "", block_size: int = 32) -> KVNamespace:
    return KVNamespace(salt=salt, fingerprint="fp", layout="slots", precision="f32", numerics="exact",
                       chunk_size=None, block_size=block_size)


def snapshot_of(tokens: list[int], *, cuts: tuple[int, ...] | None = (), shifted: bool = False) -> KVSnapshot:
    """KV whose values are a function of each token and its position (so spans of equal tokens agree)."""
    n = len(tokens)
    kv = (np.array(tokens, dtype=np.float32)[:, None] + np.arange(4, dtype=np.float32)[None]) / 7.0
    kv = np.broadcast_to(kv, (1, 1, 1, n, 4)).copy()
    return KVSnapshot.from_float(tokens, kv, -kv, precision="f32", fingerprint="fp", cuts=cuts, shifted=shifted)


def same_kv(a: KVSnapshot, b: KVSnapshot) -> bool:
    return a.tokens == b.tokens and a.cuts == b.cuts and a.shifted == b.shifted and all(
        np.array_equal(x, y) for x, y in zip(a.to_float(), b.to_float()))


PROMPT = list(range(1000, 1064))  # two full blocks shared by every session below


def test_an_offload_writes_only_the_blocks_no_tier_holds_and_gives_back_the_kv_bit_for_bit():
    store = OffloadStore(namespace_for=namespace_for)
    first, second = snapshot_of(PROMPT + list(range(40))), snapshot_of(PROMPT + list(range(50, 90)))
    a = store.put(first)
    written = store.stats().new_bytes
    b = store.put(second)
    stats = store.stats()
    assert stats.stored_blocks == 2 and stats.offloads == 2 and stats.held == 2 and stats.held_tokens == 208
    assert stats.new_bytes - written < written  # the prompt's two blocks were not written again
    back_a, back_b = a.take(), b.take()
    assert back_a is not None and back_b is not None
    assert same_kv(back_a, first) and same_kv(back_b, second)
    assert store.stats().restored_tokens == 208 and store.stats().reprefilled_tokens == 0
    assert store.stats().held == 0


def test_tenants_with_the_same_prompt_share_no_block():
    store = OffloadStore(namespace_for=namespace_for)
    store.put(snapshot_of(PROMPT), salt="team-a")
    store.put(snapshot_of(PROMPT), salt="team-b")
    assert store.stats().stored_blocks == 0


def test_a_lost_block_costs_the_re_prefill_of_what_follows_it_only():
    store = OffloadStore(namespace_for=namespace_for)
    kv = snapshot_of(list(range(100)), cuts=(40,))
    receipt = store.put(kv)
    assert receipt.load() is not None
    store.blocks.tiers[0].remove([receipt.keys[1]])  # evicted, or a disk block found corrupt
    assert receipt.load() is None  # not whole any more
    prefix = receipt.take()
    assert prefix is not None and prefix.num_tokens == 32 and same_kv(prefix, kv.prefix(32))
    assert store.stats().reprefilled_tokens == 68


def test_a_zero_budget_without_a_disk_keeps_nothing_and_says_so():
    store = OffloadStore(budget_bytes=0, namespace_for=namespace_for)
    receipt = store.put(snapshot_of(list(range(70))))
    assert receipt.take() is None
    assert store.stats().reprefilled_tokens == 70


def test_over_the_host_budget_blocks_go_to_the_disk_tier_and_come_back(tmp_path):
    store = OffloadStore(budget_bytes=0, spill_dir=tmp_path, namespace_for=namespace_for)
    kv = snapshot_of(list(range(96)))
    receipt = store.put(kv)
    back = receipt.take()
    assert back is not None and same_kv(back, kv)
    store.close()


def test_the_engine_own_tiers_keep_no_block_no_receipt_needs(tmp_path):
    store = OffloadStore(spill_dir=tmp_path, namespace_for=namespace_for)
    a = store.put(snapshot_of(PROMPT + list(range(32))))
    b = store.put(snapshot_of(PROMPT + list(range(40, 72))))
    store.blocks.flush(5.0)  # the disk tier is written behind
    a.release()
    a.release()  # twice is harmless
    assert {u.blocks for u in store.stats().tiers} == {3}  # the prompt (b still needs it) and b's own block
    b.release()
    store.blocks.flush(5.0)
    assert [u.blocks for u in store.stats().tiers] == [0, 0]
    store.close()


def test_shifted_kv_is_private_to_its_receipt_and_leaves_the_tiers_when_released():
    store = OffloadStore(namespace_for=namespace_for)
    kv = snapshot_of(list(range(70)), cuts=(5,), shifted=True)
    one, two = store.put(kv), store.put(kv)
    assert one.private and set(one.keys).isdisjoint(two.keys) and store.stats().stored_blocks == 0
    back = one.take()
    assert back is not None and same_kv(back, kv)  # shifted and its cuts, as it was
    two.release()
    assert store.stats().tiers[0].blocks == 0


def test_the_runtime_store_shares_its_blocks_and_its_collector_never_takes_an_offloaded_session(tmp_path):
    shared = BlockStore([HostBlocks(1 << 20)])
    store = OffloadStore(namespace_for=namespace_for)
    saved = snapshot_of(PROMPT + list(range(40)))
    chain = namespace_for().chain(saved.tokens, cuts=())
    shared.save(saved, chain)  # a turn-end save wrote the history
    store.use_blocks(shared, block_size=32)
    receipt = store.put(saved)
    assert store.stats().new_bytes == 0 and store.stats().stored_blocks == 3
    shared.collect(set(), older_than=timedelta(0))  # no row names them, but a live session needs them
    back = receipt.take()
    assert back is not None and same_kv(back, saved)
    assert shared.usage().tiers[0].blocks == 3  # the runtime's store keeps them for its collector to judge


def test_an_offload_store_without_the_engine_namespace_refuses_with_a_clear_error():
    with pytest.raises(UserError, match="namespace"):
        OffloadStore().put(snapshot_of([1, 2, 3]))
    with pytest.raises(UserError, match="budget"):
        OffloadStore(budget_bytes=-1)


def test_once_the_runtime_store_closes_offloads_go_back_to_the_engine_own_tiers():
    shared = BlockStore([HostBlocks(1 << 20)])
    store = OffloadStore(namespace_for=namespace_for)
    own = store.blocks
    store.use_blocks(shared, block_size=32)
    shared.close()
    kv = snapshot_of(list(range(70)))
    receipt = store.put(kv)
    assert store.blocks is own and shared.usage().tiers[0].blocks == 0
    back = receipt.take()
    assert back is not None and same_kv(back, kv)
