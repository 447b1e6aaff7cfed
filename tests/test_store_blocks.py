"""Snapshots saved as keyed blocks: each save writes only the blocks no tier holds, restores come back
bit for bit (or as the longest run still held), and the collector keeps what any row names.

Real SQLite (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set) and a real snapshot directory.
"""

from __future__ import annotations

import dataclasses
import logging
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.kvstore.block_files import DiskBlocks

FP = "test-model:kv=f32"
SPACE = KVNamespace(salt="", fingerprint=FP, layout="paged", precision="f32", numerics="exact", chunk_size=64)
HISTORY = tuple(int(t) for t in np.random.default_rng(7).integers(1, 30000, 400))


def log_snapshot(n: int, *, cuts: tuple[int, ...] = (), tokens: tuple[int, ...] = HISTORY) -> KVSnapshot:
    """The KV of ``tokens[:n]``: each position's values depend on the tokens up to it (as real KV
    does), so two logs that share a prefix share the KV of that prefix."""
    ids = np.asarray(tokens[:n], dtype=np.float64)
    mix = np.cumsum(ids) % 997
    keys = np.sin(mix[None, None, None, :, None] * np.arange(1, 9)[None, None, None, None, :]
                  + np.arange(2)[:, None, None, None, None]).astype(np.float32).repeat(2, axis=2)
    return KVSnapshot.from_float(tokens[:n], keys, keys * 0.5, precision="f32", fingerprint=FP, cuts=cuts)


async def new_conversation(store: Store) -> str:
    await store.upsert_agent("helper", "Be brief.", [], {})
    return (await store.create_conversation("helper")).id


def disk_blocks(store: Store) -> DiskBlocks:
    return next(t for t in store.blocks.tiers if isinstance(t, DiskBlocks))


def assert_same_kv(a: KVSnapshot, b: KVSnapshot) -> None:
    assert a.tokens == b.tokens and a.cuts == b.cuts
    assert all(np.array_equal(x, y) for x, y in zip(a.to_float(), b.to_float()))


@pytest.fixture
async def block_store(store_url: str, tmp_path: Path):
    opened = Store(store_url, snapshot_dir=tmp_path / "snapshots")
    yield opened
    await opened.close()


async def test_a_block_snapshot_restores_bit_for_bit_and_its_file_holds_only_the_tail(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    snap = log_snapshot(150, cuts=(20, 100, 101, 102))
    record = await block_store.save_snapshot(sid, snap, namespace=SPACE)
    assert len(record.block_keys) == 4 and record.block_size == 32 and record.kv_namespace == SPACE.id
    assert record.nbytes == snap.span(128, 150).nbytes  # the file: 22 tokens of tail
    sources: dict[str, int] = {}
    assert_same_kv(await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE,
                                                   sources=sources), snap)
    assert sources == {"host": 128, "snapshot": 22}  # this process saved it: its blocks are in memory


async def test_the_next_turn_writes_only_its_new_blocks(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    await block_store.save_snapshot(sid, log_snapshot(150, cuts=(100,)), namespace=SPACE)
    assert block_store.blocks.flush(10)
    first = block_store.blocks.usage().write_behind
    await block_store.save_snapshot(sid, log_snapshot(330, cuts=(100, 150, 151)), namespace=SPACE)
    assert block_store.blocks.flush(10)
    second = block_store.blocks.usage().write_behind
    assert first is not None and second is not None
    assert first.written_blocks == 4 and second.written_blocks - first.written_blocks == 6  # blocks 4..9
    assert len(list(disk_blocks(block_store).listing())) == 10


async def test_conversations_sharing_a_prompt_store_its_blocks_once(block_store: Store) -> None:
    shared = HISTORY[:200]
    for i in range(3):
        sid = await new_conversation(block_store)
        own = shared + tuple(range(1000 * (i + 1), 1000 * (i + 1) + 70))
        await block_store.save_snapshot(sid, log_snapshot(270, cuts=(200,), tokens=own), namespace=SPACE)
    assert block_store.blocks.flush(10)
    # 200 shared tokens: 6 full blocks shared; each conversation's own blocks: 6..7 (its cut at 200 is in block 6)
    assert len(list(disk_blocks(block_store).listing())) == 6 + 3 * 2


async def test_a_store_opened_later_restores_from_disk_alone(store_url: str, tmp_path: Path) -> None:
    first = Store(store_url, snapshot_dir=tmp_path / "snap")
    sid = await new_conversation(first)
    snap = log_snapshot(200, cuts=(64, 90))
    record = await first.save_snapshot(sid, snap, namespace=SPACE)
    await first.close()
    later = Store(store_url, snapshot_dir=tmp_path / "snap", kv_host_bytes=0)
    try:
        sources: dict[str, int] = {}
        assert_same_kv(await later.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE, sources=sources),
                       snap)
        assert sources == {"disk": 192, "snapshot": 8}
        sources.clear()  # read again: still from disk (no host tier to promote into)
        await later.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE, sources=sources)
        assert sources == {"disk": 192, "snapshot": 8}
    finally:
        await later.close()


async def test_a_lost_block_restores_the_blocks_before_it(block_store: Store, caplog) -> None:
    sid = await new_conversation(block_store)
    snap = log_snapshot(200)
    record = await block_store.save_snapshot(sid, snap, namespace=SPACE)
    assert block_store.blocks.flush(10)
    for tier in block_store.blocks.tiers:
        tier.remove([record.block_keys[3]])
    block_store.blocks.forget([record.block_keys[3]])
    with caplog.at_level(logging.WARNING, logger="agentkv.store"):
        got = await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)
    assert_same_kv(got, snap.prefix(96))
    assert "3 of its 6 blocks" in caplog.text


async def test_a_corrupt_block_on_disk_is_skipped_and_removed(store_url: str, tmp_path: Path, caplog) -> None:
    store = Store(store_url, snapshot_dir=tmp_path / "snap", kv_host_bytes=0)
    try:
        sid = await new_conversation(store)
        snap = log_snapshot(100)
        record = await store.save_snapshot(sid, snap, namespace=SPACE)
        assert store.blocks.flush(10)
        path = disk_blocks(store).path(record.block_keys[1])
        path.write_bytes(path.read_bytes()[:-9] + b"x" * 9)
        with caplog.at_level(logging.WARNING, logger="agentkv.store"):
            got = await store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)
        assert_same_kv(got, snap.prefix(32))
        assert "checksum" in caplog.text and not path.exists()
    finally:
        await store.close()


async def test_no_block_left_is_a_corrupt_snapshot(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    record = await block_store.save_snapshot(sid, log_snapshot(64), namespace=SPACE)
    assert block_store.blocks.flush(10)
    for tier in block_store.blocks.tiers:
        tier.remove(record.block_keys)
    block_store.blocks.forget(record.block_keys)
    with pytest.raises(SnapshotCorrupt, match="no block"):
        await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)


async def test_another_tenants_namespace_cannot_read_the_blocks(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    record = await block_store.save_snapshot(sid, log_snapshot(100), namespace=SPACE)
    for other in (dataclasses.replace(SPACE, salt="tenant-b"), None):
        with pytest.raises(SnapshotIncompatible):
            await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=other)


async def test_two_tenants_with_the_same_prompt_share_no_block(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    a = await block_store.save_snapshot(sid, log_snapshot(128), namespace=SPACE)
    b = await block_store.save_snapshot(sid, log_snapshot(128), namespace=dataclasses.replace(SPACE, salt="t-b"))
    assert not set(a.block_keys) & set(b.block_keys)


async def test_a_snapshot_without_cuts_or_shifted_is_saved_whole(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    plain = log_snapshot(100)
    unknown = KVSnapshot.from_float(plain.tokens, *plain.to_float(), precision="f32", fingerprint=FP)
    shifted = KVSnapshot.from_float(plain.tokens, *plain.to_float(), precision="f32", fingerprint=FP,
                                    shifted=True, cuts=())
    for snap in (unknown, shifted):
        record = await block_store.save_snapshot(sid, snap, namespace=SPACE)
        assert record.block_keys == () and record.nbytes == snap.nbytes
        got = await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)
        assert got.tokens == snap.tokens


async def test_a_namespace_of_another_block_size_is_refused(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    with pytest.raises(UserError, match="block_size=store.block_size"):
        await block_store.save_snapshot(sid, log_snapshot(100), namespace=dataclasses.replace(SPACE, block_size=64))


async def test_prune_collects_the_blocks_no_row_names_and_keeps_shared_ones(block_store: Store) -> None:
    keep, drop = await new_conversation(block_store), await new_conversation(block_store)
    kept = await block_store.save_snapshot(keep, log_snapshot(128), namespace=SPACE)
    other = HISTORY[:64] + tuple(range(5000, 5064))
    dropped = await block_store.save_snapshot(drop, log_snapshot(128, tokens=other), namespace=SPACE)
    assert block_store.blocks.flush(10)
    assert set(kept.block_keys[:2]) == set(dropped.block_keys[:2])
    await block_store.delete_conversation(drop)
    await block_store.prune(orphans_older_than=timedelta(0))
    held = {b.key for b in disk_blocks(block_store).listing()}
    assert held == set(kept.block_keys)
    got = await block_store.load_snapshot(kept, expected_fingerprint=FP, namespace=SPACE)
    assert got.num_tokens == 128


async def test_a_whole_snapshot_saved_before_blocks_still_restores(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    snap = log_snapshot(90)
    record = await block_store.save_snapshot(sid, snap)  # no namespace: the way every snapshot was saved
    assert record.block_keys == ()
    assert_same_kv(await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE), snap)


async def test_a_database_and_snapshot_file_from_before_blocks_upgrade_and_restore(store_url: str,
                                                                                   tmp_path: Path) -> None:
    from sqlalchemy import create_engine, text

    from _old_schema import schema_at
    from agentkv.kv.digest import tokens_digest
    from agentkv.memory.schema import utcnow

    old = log_snapshot(70)
    # no cuts: as every snapshot was written before
    whole = KVSnapshot.from_float(old.tokens, *old.to_float(), precision="f32", fingerprint=FP)
    (tmp_path / "s").mkdir()
    whole.to_file(tmp_path / "s" / "old.agkv")
    engine = create_engine(store_url)
    now = utcnow().replace(tzinfo=None)
    with engine.begin() as conn:
        schema_at(conn, 11)
        conn.execute(text("INSERT INTO agents (name, instructions, tool_names, settings, updated_at) "
                          "VALUES ('old', 'Be kind.', '[]', '{}', :now)"), {"now": now})
        conn.execute(text("INSERT INTO sessions (id, agent_name, created_at, updated_at, metadata, lease_epoch) "
                          "VALUES ('s1', 'old', :now, :now, '{}', 0)"), {"now": now})
        conn.execute(text("INSERT INTO kv_snapshots (session_id, num_tokens, token_hash, fingerprint, precision, path, "
                          "checksum, nbytes, shifted, created_at) VALUES ('s1', 70, :hash, :fp, 'f32', 'old.agkv', "
                          ":checksum, :nbytes, false, :now)"),
                     {"hash": tokens_digest(whole.tokens), "fp": FP, "checksum": whole.checksum(),
                      "nbytes": whole.nbytes, "now": now})
    engine.dispose()
    upgraded = Store(store_url, snapshot_dir=tmp_path / "s")
    try:
        (record,) = await upgraded.snapshots("s1")
        assert record.block_keys == () and record.kv_namespace is None
        got = await upgraded.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)
        assert got.tokens == whole.tokens and got.cuts is None
        assert all(np.array_equal(x, y) for x, y in zip(got.to_float(), whole.to_float()))
    finally:
        await upgraded.close()


async def test_another_store_on_the_same_bucket_restores_the_blocks_a_replica_wrote(store_url: str) -> None:
    import os
    import uuid

    base = os.environ.get("AGENTKV_TEST_S3_URL")
    if not base:
        pytest.skip("no S3 server: set AGENTKV_TEST_S3_URL (eval \"$(bash scripts/start_s3.sh)\")")
    bucket_url = f"{base.rstrip('/')}/{uuid.uuid4().hex[:12]}"
    writer = Store(store_url, snapshots=bucket_url)
    sid = await new_conversation(writer)
    first = await writer.save_snapshot(sid, log_snapshot(100, cuts=(40,)), namespace=SPACE)
    snap = log_snapshot(260, cuts=(40, 100, 101))
    record = await writer.save_snapshot(sid, snap, namespace=SPACE)
    await writer.close()  # the queue is written before close returns
    assert record.block_keys[:3] == first.block_keys
    reader = Store(store_url, snapshots=bucket_url, kv_host_bytes=0)
    try:
        sources: dict[str, int] = {}
        assert_same_kv(await reader.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE, sources=sources),
                       snap)
        assert sources == {"s3": 256, "snapshot": 4}
        s3 = next(u for u in reader.blocks.usage().tiers if u.tier == "s3")
        assert s3.hits == len(record.block_keys) and s3.misses == 0
    finally:
        await reader.close()


async def test_a_full_disk_costs_the_blocks_not_the_save(block_store: Store, monkeypatch, caplog) -> None:
    import errno

    from agentkv.kvstore.block_tiers import BlockTierUnavailable

    def full(self, key: str, data: bytes) -> None:
        raise BlockTierUnavailable(f"no space left on the device ({errno.ENOSPC})")

    monkeypatch.setattr(DiskBlocks, "put", full)
    sid = await new_conversation(block_store)
    record = await block_store.save_snapshot(sid, log_snapshot(100), namespace=SPACE)  # no exception
    assert len(record.block_keys) == 3
    usage = block_store.blocks.usage().write_behind
    assert usage is not None and usage.failed_blocks == 3
    host = block_store.blocks.tiers[0]
    assert host.has_many(record.block_keys) == set()  # memory never hides a block no disk holds
    await block_store.save_snapshot(sid, log_snapshot(100), namespace=SPACE)  # the disk is still full:
    usage = block_store.blocks.usage().write_behind  # the blocks were queued again, and failed again
    assert usage is not None and usage.failed_blocks == 6
    for tier in block_store.blocks.tiers:  # a later process: nothing in memory
        tier.remove(record.block_keys)
    block_store.blocks.forget(record.block_keys)
    with pytest.raises(SnapshotCorrupt):  # what a restore skips, then the conversation re-prefills
        await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE)


async def test_a_save_of_the_span_past_the_stored_blocks_restores_the_whole_log(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    await block_store.save_snapshot(sid, log_snapshot(150, cuts=(100,)), namespace=SPACE)
    whole = log_snapshot(260, cuts=(100, 150, 151))
    log = (whole.tokens, whole.cuts)
    first = block_store.blocks.first_unknown(SPACE.chain(whole.tokens, cuts=whole.cuts).keys)
    assert first == 4  # blocks 0..3 were saved with the first turn; block 4 now holds the cut at 150
    record = await block_store.save_snapshot(sid, whole.span(128, 260), namespace=SPACE, log=log)
    assert record.num_tokens == 260 and len(record.block_keys) == 8
    assert_same_kv(await block_store.load_snapshot(record, expected_fingerprint=FP, namespace=SPACE), whole)


async def test_a_span_without_its_log_or_a_namespace_is_refused(block_store: Store) -> None:
    sid = await new_conversation(block_store)
    whole = log_snapshot(96)
    with pytest.raises(UserError, match="whole log"):
        await block_store.save_snapshot(sid, whole.span(64, 96), log=(whole.tokens, ()))
