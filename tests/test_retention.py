"""Retention, on SQLite and PostgreSQL: snapshots capped per session and by a byte budget (the
sessions used longest ago lose theirs), prune of old sessions, surplus snapshots and orphaned
files — never a file a row points to, and a crash during prune loses nothing that was kept."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from agentkv.chat.messages import Message
from agentkv.cli.app import app
from agentkv.kv.snapshot import KVSnapshot
from agentkv.errors import ConversationNotFound, UserError
from agentkv.memory import Store

FP = "test-model|kv:u8"


def snapshot(num_tokens: int, seed: int = 0) -> KVSnapshot:
    keys = np.random.default_rng(seed).standard_normal((2, 1, 3, num_tokens, 64), dtype=np.float32)
    return KVSnapshot.from_float(range(num_tokens), keys, -keys, precision="u8", fingerprint=FP)


async def session(store: Store) -> str:
    await store.upsert_agent("helper", None, [], {})
    sid = (await store.create_conversation("helper")).id
    await store.append_message(sid, Message.user("hi"), token_count=2)
    return sid


@pytest.fixture
async def make_store(store_url: str, tmp_path: Path):
    """``make_store(**options)``: a store on the test database, closed after the test (an open
    pool would keep PostgreSQL from dropping the database)."""
    made: list[Store] = []

    def make(**options) -> Store:
        made.append(Store(store_url, snapshot_dir=tmp_path / "kv", **options))
        return made[-1]

    yield make
    for store in made:
        await store.close()


def files_in(store: Store) -> set[str]:
    return {p.name for p in store.files.directory.glob("*.agkv")} if store.files.directory.is_dir() else set()


def age(store: Store, conversation_id: str, days: int) -> None:
    """Make a session look ``days`` old (its updated_at), as the clock would."""
    from sqlalchemy import update

    from agentkv.memory.schema import ConversationRow, utcnow

    store.database.write(lambda s: s.execute(update(ConversationRow).where(ConversationRow.id == conversation_id)
                                             .values(updated_at=utcnow() - timedelta(days=days))))


async def test_each_session_keeps_its_newest_snapshots_as_configured(make_store):
    store = make_store(keep_snapshots=1)
    sid = await session(store)
    for seed in range(3):
        await store.save_snapshot(sid, snapshot(4 + seed, seed))
    assert [r.num_tokens for r in await store.snapshots(sid)] == [6] and len(files_in(store)) == 1
    with pytest.raises(UserError, match="keep_snapshots must be >= 1"):
        make_store(keep_snapshots=0)


async def test_the_byte_budget_takes_the_snapshots_of_the_sessions_used_longest_ago(make_store):
    one = snapshot(8).nbytes
    store = make_store(snapshot_budget_bytes=int(2.5 * one))
    oldest, middle, newest = [await session(store) for _ in range(3)]
    for sid in (oldest, middle):
        await store.save_snapshot(sid, snapshot(8))
        time.sleep(0.01)
    await store.save_snapshot(newest, snapshot(8))  # over budget: the oldest session's go
    assert await store.snapshots(oldest) == []
    assert len(await store.snapshots(middle)) == 1 and len(await store.snapshots(newest)) == 1
    assert len(files_in(store)) == 2
    assert len(await store.messages(oldest)) == 1  # only the KV cache went; it re-prefills


async def test_prune_deletes_old_sessions_surplus_snapshots_and_orphans_but_no_file_a_row_needs(make_store):
    store = make_store(keep_snapshots=3)
    old, kept = await session(store), await session(store)
    await store.save_snapshot(old, snapshot(4))
    for seed in range(3):
        await store.save_snapshot(kept, snapshot(4 + seed, seed))
    age(store, old, days=40)
    orphan = store.files.directory / "crashed-save.agkv"
    orphan.write_bytes(b"left by a crash")
    fresh = store.files.directory / "saving-now.agkv"
    fresh.write_bytes(b"a save in progress")
    os.utime(orphan, (time.time() - 3600, time.time() - 3600))
    report = await store.prune(older_than=timedelta(days=30), keep_snapshots=1)
    assert report.conversations == (old,) and report.orphan_files == 1 and report.snapshots == 4
    assert report.bytes_freed > 0
    with pytest.raises(ConversationNotFound):
        await store.get_conversation(old)
    [left] = await store.snapshots(kept)
    assert left.path.exists() and left.num_tokens == 6
    assert files_in(store) == {left.path.name, fresh.name}  # the young unreferenced file may be a save
    assert (await store.load_snapshot(left, expected_fingerprint=FP)).num_tokens == 6


async def test_prune_keeps_a_parent_whose_forks_stay(make_store):
    store = make_store()
    parent = await session(store)
    fork = (await store.fork_conversation(parent)).id
    age(store, parent, days=40)
    assert (await store.prune(older_than=timedelta(days=30))).conversations == ()
    age(store, fork, days=40)
    assert set((await store.prune(older_than=timedelta(days=30))).conversations) == {parent, fork}


async def test_a_crash_during_prune_loses_nothing_that_was_kept(make_store, monkeypatch):
    store = make_store(keep_snapshots=3)
    old, kept = await session(store), await session(store)
    await store.save_snapshot(old, snapshot(4))
    [record] = [await store.save_snapshot(kept, snapshot(5))]
    age(store, old, days=40)
    # a crash inside the transaction: nothing is deleted
    monkeypatch.setattr("agentkv.memory.retention.excess_snapshots", lambda *args, **kwargs: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        await store.prune(older_than=timedelta(days=30), keep_snapshots=1)
    await store.get_conversation(old)
    assert len(files_in(store)) == 2
    monkeypatch.undo()
    # a crash after the commit, before the files go: kept rows and files intact, the rest orphaned
    monkeypatch.setattr(store.files, "remove", lambda names: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        await store.prune(older_than=timedelta(days=30))
    monkeypatch.undo()
    assert (await store.load_snapshot(record, expected_fingerprint=FP)).num_tokens == 5
    report = await store.prune(orphans_older_than=timedelta(0))
    assert report.orphan_files == 1 and files_in(store) == {record.path.name}


def test_cli_prune_reports_what_it_deleted(tmp_path: Path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    result = CliRunner().invoke(app, ["conversations", "prune", "--older-than", "30d", "--keep-snapshots", "1",
                                      "--db", db])
    assert result.exit_code == 0 and "deleted 0 conversations" in result.output
    bad = CliRunner().invoke(app, ["conversations", "prune", "--older-than", "soon", "--db", db])
    assert bad.exit_code == 2 and "30d" in bad.output


class RecordingKV:
    """Stands in for a KV session: records the snapshots restored into it."""

    def __init__(self) -> None:
        self.restored: list[int] = []

    async def restore(self, snapshot: KVSnapshot) -> None:
        self.restored.append(snapshot.num_tokens)


def cut_short(path: Path) -> None:
    """What a full disk or a crash can leave: the file's first bytes only."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


async def test_retention_keeps_a_whole_older_snapshot_over_a_newer_one_known_to_be_cut_short(make_store):
    from agentkv.runtime.persistence import restore_newest_snapshot

    store = make_store(keep_snapshots=2)
    sid = await session(store)
    good = await store.save_snapshot(sid, snapshot(6, seed=1))
    damaged = await store.save_snapshot(sid, snapshot(7, seed=2))
    cut_short(damaged.path)
    newest = await store.save_snapshot(sid, snapshot(8, seed=3))
    assert [r.id for r in await store.snapshots(sid)] == [newest.id, good.id]  # the damaged one went
    assert files_in(store) == {newest.path.name, good.path.name}
    newest.path.write_bytes(b"\0" * newest.path.stat().st_size)  # later, the newest is corrupted too
    kv = RecordingKV()
    restored = await restore_newest_snapshot(store, sid, kv, tuple(range(8)), FP)  # type: ignore[arg-type]
    assert restored.tokens == 6 and kv.restored == [6]  # the good older one comes back, not a prefill from zero


async def test_prune_keeps_whole_snapshots_before_missing_ones(make_store):
    store = make_store(keep_snapshots=3)
    sid = await session(store)
    good = await store.save_snapshot(sid, snapshot(4, seed=1))
    gone = await store.save_snapshot(sid, snapshot(5, seed=2))
    gone.path.unlink()
    await store.prune(keep_snapshots=1)
    assert [r.id for r in await store.snapshots(sid)] == [good.id]
