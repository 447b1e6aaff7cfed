"""Slot offload on the real model: 20 sessions on 2 slots, the host byte budget (spill / drop), fork, snapshot errors.

Every session plants its own "needle" word; its greedy outputs must equal its solo run and
never show another session's needle (no KV cross-talk), and the metrics must show restores,
not re-prefills.
"""

from __future__ import annotations


import numpy as np

from agentkv.engine.session.slot_pool import HostKVStore
from agentkv.kv.snapshot import KVSnapshot


def tiny_snapshot(n_tokens: int, fill: float = 1.0) -> KVSnapshot:
    kv = np.full((1, 1, 1, n_tokens, 4), fill, dtype=np.float32)
    return KVSnapshot.from_float(range(n_tokens), kv, kv, precision="f32", fingerprint="fp")


def test_host_store_spills_the_least_recently_offloaded_first_and_stays_in_budget(tmp_path):
    per_token = tiny_snapshot(1).nbytes
    store = HostKVStore(budget_bytes=5 * per_token, spill_dir=tmp_path)
    a, b, c = store.put(tiny_snapshot(3, 1.0)), store.put(tiny_snapshot(2, 2.0)), store.put(tiny_snapshot(2, 3.0))
    assert (a.where, b.where, c.where) == ("disk", "memory", "memory")
    assert store.stats().bytes == 4 * per_token and store.stats().on_disk == 1
    assert b.load() is not None  # touching b makes c the least recent
    store.put(tiny_snapshot(2, 4.0))
    assert (b.where, c.where) == ("memory", "disk")
    back = a.take()
    assert back is not None and back.tokens == (0, 1, 2) and float(back.to_float()[0].max()) == 1.0
    a.release()  # twice is harmless
    assert len(list(tmp_path.iterdir())) == 1 and store.stats().disk_loads == 1


def test_spill_files_and_stored_snapshots_share_one_suffix_from_the_engine_side(tmp_path):
    from agentkv.kv import snapshot
    from agentkv.memory import snapshots as stored

    store = HostKVStore(budget_bytes=0, spill_dir=tmp_path)
    assert store.put(tiny_snapshot(2)).where == "disk"
    assert [p.suffix for p in tmp_path.iterdir()] == [snapshot.SUFFIX]
    assert stored.SUFFIX is snapshot.SUFFIX
    assert stored.SnapshotFiles(tmp_path).write("s", tiny_snapshot(2)).endswith(snapshot.SUFFIX)


def test_host_store_without_a_spill_dir_drops_and_counts_the_re_prefill():
    store = HostKVStore(budget_bytes=0)
    entry = store.put(tiny_snapshot(3))
    assert entry.where == "dropped" and entry.take() is None
    assert store.stats().drops == 1 and store.stats().reprefilled_tokens == 3 and store.stats().bytes == 0


