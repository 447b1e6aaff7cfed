"""Store's KV snapshots on real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set):
save and load, pruning, corrupt, missing and swapped files, and none for a missing session."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from _stores import CONVERSATION, FP, append_all, make_snapshot, new_conversation

from agentkv.errors import ConversationNotFound, SnapshotCorrupt, SnapshotIncompatible
from agentkv.memory import Store


async def test_snapshot_save_and_load_round_trip(store: Store) -> None:
    sid = await new_conversation(store)
    snapshot = make_snapshot(7)
    record = await store.save_snapshot(sid, snapshot)
    assert (record.num_tokens, record.precision, record.fingerprint) == (7, "u8", FP)
    assert record.path.exists() and record.checksum == snapshot.checksum()
    assert record.nbytes == snapshot.nbytes
    assert await store.snapshots(sid) == [record]

    loaded = await store.load_snapshot(record, expected_fingerprint=FP)
    assert loaded.tokens == snapshot.tokens
    np.testing.assert_array_equal(loaded.to_float()[0], snapshot.to_float()[0])
    with pytest.raises(SnapshotIncompatible):
        await store.load_snapshot(record, expected_fingerprint="another-model")


async def test_saving_prunes_all_but_the_newest_snapshots(store: Store) -> None:
    sid = await new_conversation(store)
    records = [await store.save_snapshot(sid, make_snapshot(3 + i, seed=i)) for i in range(3)]
    listed = await store.snapshots(sid)
    assert [r.num_tokens for r in listed] == [5, 4]  # newest first
    assert not records[0].path.exists() and all(r.path.exists() for r in records[1:])
    assert sorted(p.name for p in records[0].path.parent.iterdir()) == sorted(
        r.path.name for r in records[1:])


async def test_a_corrupt_snapshot_raises_and_nothing_else_is_lost(store: Store) -> None:
    sid = await new_conversation(store)
    await append_all(store, sid, CONVERSATION)
    older = await store.save_snapshot(sid, make_snapshot(4, seed=1))
    newer = await store.save_snapshot(sid, make_snapshot(6, seed=2))
    data = bytearray(newer.path.read_bytes())
    data[-10] ^= 0xFF
    newer.path.write_bytes(bytes(data))

    with pytest.raises(SnapshotCorrupt, match="delete it"):
        await store.load_snapshot(newer, expected_fingerprint=FP)
    assert (await store.load_snapshot(older, expected_fingerprint=FP)).num_tokens == 4
    assert [m.message for m in await store.messages(sid)] == CONVERSATION
    await store.delete_snapshot(newer)
    assert await store.snapshots(sid) == [older] and not newer.path.exists()


async def test_a_missing_or_swapped_snapshot_file_is_corrupt(store: Store) -> None:
    sid = await new_conversation(store)
    first = await store.save_snapshot(sid, make_snapshot(4, seed=1))
    second = await store.save_snapshot(sid, make_snapshot(4, seed=2))
    second.path.write_bytes(first.path.read_bytes())  # valid file, but not this row's
    with pytest.raises(SnapshotCorrupt, match="not the file"):
        await store.load_snapshot(second, expected_fingerprint=FP)
    first.path.unlink()
    with pytest.raises(SnapshotCorrupt, match="cannot be read"):
        await store.load_snapshot(first, expected_fingerprint=FP)


async def test_a_snapshot_for_a_missing_session_writes_no_file(store: Store, tmp_path: Path) -> None:
    with pytest.raises(ConversationNotFound):
        await store.save_snapshot("absent", make_snapshot(2))
    snapshot_dir = tmp_path / "snapshots"
    assert not snapshot_dir.exists() or not any(snapshot_dir.iterdir())
