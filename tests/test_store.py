"""Tests for agentkv.memory.Store on real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set)."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from sqlalchemy import create_engine, insert, inspect, text
from sqlalchemy.exc import OperationalError

from _old_schema import schema_at

from agentkv.chat.messages import Message, ToolCall
from agentkv.kv.snapshot import KVSnapshot
from agentkv.errors import (
    AgentNotFound,
    SchemaVersionError,
    SessionBusy,
    SessionNotFound,
    SnapshotCorrupt,
    SnapshotIncompatible,
    StoreLocked,
    UserError,
)
from agentkv.memory import Store
from agentkv.memory.database import retry_locked
from agentkv.memory.migrations import LATEST_VERSION, MIGRATIONS, schema_version
from agentkv.memory.schema import Base, utcnow

REPO = Path(__file__).resolve().parents[1]
FP = "test-model|kv:u8"


async def new_session(store: Store, session_id: str | None = None) -> str:
    await store.upsert_agent("helper", "Be brief.", ["calc"], {"temperature": 0})
    return (await store.create_session("helper", session_id=session_id)).id


def make_snapshot(num_tokens: int, seed: int = 0, fingerprint: str = FP) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, 1, 3, num_tokens, 64), dtype=np.float32)
    return KVSnapshot.from_float(range(num_tokens), keys, -keys, precision="u8",
                                 fingerprint=fingerprint)


CALL = ToolCall(id="call_1", name="calc", arguments={"expr": "1+1"})
CONVERSATION = [
    Message.system("Be brief."),
    Message.user("what is 1+1?"),
    Message.assistant("", tool_calls=[CALL], token_ids=[5, 6, 7]),
    Message.tool("2", tool_call_id="call_1", name="calc"),
    Message.assistant("2", token_ids=[9]),
]


async def append_all(store: Store, sid: str, messages: list[Message]) -> None:
    for i, message in enumerate(messages):
        await store.append_message(sid, message, token_count=10 + i)


# -- agents, sessions, messages --------------------------------------------------------------

async def test_messages_come_back_in_append_order_with_seqs_1_to_n(store: Store) -> None:
    sid = await new_session(store)
    await append_all(store, sid, CONVERSATION)
    stored = await store.messages(sid)
    assert [m.seq for m in stored] == [1, 2, 3, 4, 5]
    assert [m.message for m in stored] == CONVERSATION
    assert [m.token_count for m in stored] == [10, 11, 12, 13, 14]
    assert all(m.in_window and m.replaced_by_seq is None for m in stored)


async def test_out_of_window_messages_stay_stored_with_their_summary(store: Store) -> None:
    sid = await new_session(store)
    await append_all(store, sid, CONVERSATION)
    summary = await store.append_message(sid, Message.user("[summary] asked 1+1, got 2"),
                                         token_count=8)
    await store.mark_out_of_window(sid, [2, 3, 4], replaced_by_seq=summary.seq)

    assert [m.seq for m in await store.messages(sid, in_window_only=True)] == [1, 5, 6]
    everything = await store.messages(sid)
    assert len(everything) == 6
    assert [(m.in_window, m.replaced_by_seq) for m in everything[1:4]] == [(False, 6)] * 3
    with pytest.raises(UserError, match=r"\[42\]"):
        await store.mark_out_of_window(sid, [1, 42])
    with pytest.raises(UserError, match="replace itself"):
        await store.mark_out_of_window(sid, [6], replaced_by_seq=6)


async def test_list_sessions_counts_messages_and_tokens(store: Store) -> None:
    busy = await new_session(store, "busy")
    await new_session(store, "empty")
    await append_all(store, busy, CONVERSATION[:3])  # token counts 10, 11, 12
    await store.mark_out_of_window(busy, [1])

    summaries = {s.id: s for s in await store.list_sessions()}
    assert (summaries["busy"].message_count, summaries["busy"].total_tokens,
            summaries["busy"].in_window_tokens) == (3, 33, 23)
    assert (summaries["empty"].message_count, summaries["empty"].total_tokens) == (0, 0)
    assert [s.id for s in await store.list_sessions()] == ["busy", "empty"]  # newest update first


async def test_agents_upsert_and_sessions_need_a_stored_agent(store: Store) -> None:
    with pytest.raises(AgentNotFound, match="upsert_agent"):
        await store.create_session("nobody")
    await store.upsert_agent("helper", "v1", ["a"], {})
    await store.upsert_agent("helper", "v2", ["a", "b"], {"top_k": 4})
    agent = await store.get_agent("helper")
    assert (agent.instructions, agent.tool_names, agent.settings) == ("v2", ("a", "b"), {"top_k": 4})

    session = await store.create_session("helper", session_id="s1", metadata={"user": "ann"})
    assert (await store.get_session("s1")).metadata == {"user": "ann"} == session.metadata
    with pytest.raises(UserError, match="already exists"):
        await store.create_session("helper", session_id="s1")
    with pytest.raises(UserError, match="JSON"):
        await store.create_session("helper", metadata={"when": object()})
    with pytest.raises(SessionNotFound):
        await store.get_session("absent")


async def test_history_survives_reopening_the_store(store_url: str, tmp_path: Path) -> None:
    first = Store(store_url, snapshot_dir=tmp_path / "snaps")
    sid = await new_session(first)
    await append_all(first, sid, CONVERSATION)
    await first.close()
    second = Store(store_url, snapshot_dir=tmp_path / "snaps")
    assert [m.message for m in await second.messages(sid)] == CONVERSATION
    await second.close()


async def test_delete_session_removes_rows_and_snapshot_files(store: Store) -> None:
    doomed, kept = await new_session(store, "doomed"), await new_session(store, "kept")
    await append_all(store, doomed, CONVERSATION)
    await append_all(store, kept, CONVERSATION[:2])
    doomed_files = [(await store.save_snapshot(doomed, make_snapshot(4, s))).path for s in (1, 2)]
    kept_file = (await store.save_snapshot(kept, make_snapshot(4, 3))).path

    await store.delete_session(doomed)
    assert not any(path.exists() for path in doomed_files) and kept_file.exists()
    with pytest.raises(SessionNotFound):
        await store.messages(doomed)
    with pytest.raises(SessionNotFound):
        await store.delete_session(doomed)
    assert len(await store.messages(kept)) == 2
    assert [s.id for s in await store.list_sessions()] == ["kept"]


async def test_export_jsonl_writes_openai_chat_messages_one_per_line(store: Store) -> None:
    sid = await new_session(store)
    await append_all(store, sid, CONVERSATION)
    exported = await store.export_jsonl(sid)
    lines = exported.splitlines()
    assert exported.endswith("\n") and len(lines) == len(CONVERSATION) + 1
    rows = [json.loads(line) for line in lines]
    assert rows == [{"role": "system", "content": "Be brief."}, *(m.to_openai() for m in CONVERSATION)]
    rows = rows[1:]
    assert rows[2]["tool_calls"][0]["function"] == {"name": "calc", "arguments": '{"expr": "1+1"}'}
    assert rows[3] == {"role": "tool", "content": "2", "tool_call_id": "call_1", "name": "calc"}


async def test_concurrent_appends_keep_every_message_with_unique_seqs(store: Store) -> None:
    sid = await new_session(store)
    async with anyio.create_task_group() as tg:
        for i in range(40):
            tg.start_soon(lambda i=i: store.append_message(sid, Message.user(f"m{i}"),
                                                           token_count=1))
    stored = await store.messages(sid)
    assert [m.seq for m in stored] == list(range(1, 41))
    assert sorted(m.message.content for m in stored) == sorted(f"m{i}" for i in range(40))


async def test_cancelled_appends_leave_a_gapless_history(store: Store) -> None:
    sid = await new_session(store)
    with anyio.move_on_after(0.05):
        async with anyio.create_task_group() as tg:
            for i in range(30):
                tg.start_soon(lambda i=i: store.append_message(sid, Message.user(f"m{i}"),
                                                               token_count=1))
    await anyio.sleep(0.3)  # worker threads finish the transactions they had started
    stored = await store.messages(sid)
    contents = [m.message.content for m in stored]
    assert [m.seq for m in stored] == list(range(1, len(stored) + 1))
    assert len(set(contents)) == len(contents)


# -- leases ----------------------------------------------------------------------------------

async def test_second_holder_is_busy_until_the_lease_is_released(store: Store) -> None:
    sid = await new_session(store)
    await store.acquire_lease(sid, "worker-a", ttl_s=30)
    with pytest.raises(SessionBusy, match="worker-a") as busy:
        await store.acquire_lease(sid, "worker-b")
    assert busy.value.holder == "worker-a"

    first_expiry = (await store.get_session(sid)).lease_expires_at
    await store.acquire_lease(sid, "worker-a", ttl_s=300)  # the holder renews
    renewed = await store.get_session(sid)
    assert renewed.lease_holder == "worker-a" and renewed.lease_expires_at > first_expiry

    await store.release_lease(sid, "worker-b")  # not the holder: nothing happens
    assert (await store.get_session(sid)).lease_holder == "worker-a"
    await store.release_lease(sid, "worker-a")
    await store.release_lease(sid, "worker-a")  # releasing twice is harmless
    await store.acquire_lease(sid, "worker-b")
    assert (await store.get_session(sid)).lease_holder == "worker-b"


async def test_an_expired_lease_is_taken_over(store: Store) -> None:
    sid = await new_session(store)
    await store.acquire_lease(sid, "crashed-worker", ttl_s=0.05)
    await anyio.sleep(0.1)
    await store.acquire_lease(sid, "worker-b")
    assert (await store.get_session(sid)).lease_holder == "worker-b"


async def test_a_lease_on_a_missing_session_is_not_found(store: Store) -> None:
    with pytest.raises(SessionNotFound):
        await store.acquire_lease("absent", "worker-a")


RACE_WORKER = """
import os, sys, time, anyio
from agentkv.errors import SessionBusy
from agentkv.memory import Store

url, snapshot_dir, session_id, holder, go_file = sys.argv[1:6]
store = Store(url, snapshot_dir=snapshot_dir)

async def main():
    await store.get_session(session_id)  # connect and check the schema before the start line
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    try:
        await store.acquire_lease(session_id, holder, ttl_s=60)
        print("won", flush=True)
    except SessionBusy:
        print("busy", flush=True)

anyio.run(main)
"""


async def race_for_lease(store_url: str, tmp_path: Path, sid: str, holders: list[str]) -> list[tuple[str, str]]:
    """Start one process per holder, release them together, return each (stdout, stderr)."""
    go_file = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [
        subprocess.Popen([sys.executable, "-c", RACE_WORKER, store_url, str(tmp_path / "s"), sid, holder,
                          str(go_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for holder in holders
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert await anyio.to_thread.run_sync(worker.stdout.readline) == "ready\n"
        go_file.touch()
        return [await anyio.to_thread.run_sync(lambda w=w: w.communicate(timeout=60)) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


async def test_processes_racing_for_one_lease_exactly_one_wins(store: Store, store_url: str,
                                                                tmp_path: Path) -> None:
    sid = await new_session(store)
    outputs = await race_for_lease(store_url, tmp_path, sid, [f"proc-{i}" for i in range(3)])
    results = sorted(out.strip() for out, _ in outputs)
    assert results == ["busy", "busy", "won"], [err for _, err in outputs]
    holder = (await store.get_session(sid)).lease_holder
    assert holder is not None and holder.startswith("proc-")


# -- schema ----------------------------------------------------------------------------------

async def test_a_database_from_a_newer_schema_is_refused(store: Store, store_url: str,
                                                         tmp_path: Path) -> None:
    await new_session(store)  # creates the schema
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(insert(schema_version).values(version=LATEST_VERSION + 1, name="future",
                                                   applied_at=utcnow().replace(tzinfo=None)))
    engine.dispose()
    newer = Store(store_url, snapshot_dir=tmp_path / "s")
    with pytest.raises(SchemaVersionError, match="upgrade agentkv"):
        await newer.list_sessions()
    await newer.close()


async def test_stores_opening_one_fresh_database_at_once_all_succeed(store_url: str,
                                                                     tmp_path: Path) -> None:
    stores = [Store(store_url, snapshot_dir=tmp_path / "s") for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for opened in stores:
            tg.start_soon(opened.list_sessions)
    engine = create_engine(store_url)
    with engine.connect() as conn:
        applied = conn.execute(text("SELECT version FROM schema_version ORDER BY version")).all()
    engine.dispose()
    assert [v for (v,) in applied] == list(range(1, LATEST_VERSION + 1))
    for opened in stores:
        await opened.close()


async def test_migrations_build_the_tables_the_orm_declares(store: Store, store_url: str) -> None:
    await store.list_sessions()  # runs the migrations
    assert [m.version for m in MIGRATIONS] == list(range(1, LATEST_VERSION + 1))
    engine = create_engine(store_url)
    inspector = inspect(engine)
    for table in Base.metadata.sorted_tables:
        assert {c["name"] for c in inspector.get_columns(table.name)} == set(table.columns.keys())
        declared = {index.name for index in table.indexes}
        assert declared <= {index["name"] for index in inspector.get_indexes(table.name)}
    with engine.connect() as conn:
        applied = conn.execute(text("SELECT version FROM schema_version ORDER BY version")).all()
    engine.dispose()
    assert [v for (v,) in applied] == list(range(1, LATEST_VERSION + 1))


# -- snapshots -------------------------------------------------------------------------------

async def test_snapshot_save_and_load_round_trip(store: Store) -> None:
    sid = await new_session(store)
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
    sid = await new_session(store)
    records = [await store.save_snapshot(sid, make_snapshot(3 + i, seed=i)) for i in range(3)]
    listed = await store.snapshots(sid)
    assert [r.num_tokens for r in listed] == [5, 4]  # newest first
    assert not records[0].path.exists() and all(r.path.exists() for r in records[1:])
    assert sorted(p.name for p in records[0].path.parent.iterdir()) == sorted(
        r.path.name for r in records[1:])


async def test_a_corrupt_snapshot_raises_and_nothing_else_is_lost(store: Store) -> None:
    sid = await new_session(store)
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
    sid = await new_session(store)
    first = await store.save_snapshot(sid, make_snapshot(4, seed=1))
    second = await store.save_snapshot(sid, make_snapshot(4, seed=2))
    second.path.write_bytes(first.path.read_bytes())  # valid file, but not this row's
    with pytest.raises(SnapshotCorrupt, match="not the file"):
        await store.load_snapshot(second, expected_fingerprint=FP)
    first.path.unlink()
    with pytest.raises(SnapshotCorrupt, match="cannot be read"):
        await store.load_snapshot(first, expected_fingerprint=FP)


async def test_a_snapshot_for_a_missing_session_writes_no_file(store: Store, tmp_path: Path) -> None:
    with pytest.raises(SessionNotFound):
        await store.save_snapshot("absent", make_snapshot(2))
    snapshot_dir = tmp_path / "snapshots"
    assert not snapshot_dir.exists() or not any(snapshot_dir.iterdir())


# -- SQLite specifics and configuration (no PostgreSQL variant) ------------------------------

async def test_a_write_waits_for_another_connections_lock(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    sid = await new_session(store)
    blocker = sqlite3.connect(tmp_path / "a.db", isolation_level=None, check_same_thread=False)
    blocker.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, lambda: blocker.execute("COMMIT")).start()
    started = time.monotonic()
    await store.append_message(sid, Message.user("after the lock"), token_count=1)
    assert time.monotonic() - started >= 0.25
    assert [m.message.content for m in await store.messages(sid)] == ["after the lock"]
    blocker.close()
    await store.close()


def test_retry_locked_retries_a_bounded_number_of_times() -> None:
    calls: list[int] = []

    def locked_twice() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))
        return "done"

    assert retry_locked(locked_twice, first_delay_s=0.001) == "done" and len(calls) == 3

    def always_locked() -> None:
        raise OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))

    with pytest.raises(StoreLocked, match="retry later"):
        retry_locked(always_locked, attempts=3, first_delay_s=0.001)


def test_retry_locked_chains_the_lock_error_and_passes_other_errors_at_once() -> None:
    lock_error = OperationalError("INSERT", {}, sqlite3.OperationalError("database is locked"))

    def always_locked() -> None:
        raise lock_error

    with pytest.raises(StoreLocked, match="through 2 attempts") as raised:
        retry_locked(always_locked, attempts=2, first_delay_s=0.001)
    assert raised.value.__cause__ is lock_error

    calls: list[int] = []

    def missing_table() -> None:
        calls.append(1)
        raise OperationalError("INSERT", {}, sqlite3.OperationalError("no such table: rows"))

    with pytest.raises(OperationalError, match="no such table"):
        retry_locked(missing_table, first_delay_s=0.001)
    assert len(calls) == 1


async def test_from_env_reads_the_url_and_keeps_snapshots_beside_the_db(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENTKV_DB_URL", f"sqlite:///{tmp_path / 'env.db'}")
    store = Store.from_env()
    sid = await new_session(store)
    record = await store.save_snapshot(sid, make_snapshot(2))
    assert (tmp_path / "env.db").exists()
    assert record.path.parent == tmp_path / "snapshots"
    await store.close()


async def test_an_in_memory_database_supports_concurrent_use(tmp_path: Path) -> None:
    store = Store("sqlite://", snapshot_dir=tmp_path / "snaps")
    sid = await new_session(store)
    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(lambda i=i: store.append_message(sid, Message.user(str(i)),
                                                           token_count=1))
    assert [m.seq for m in await store.messages(sid)] == list(range(1, 11))
    await store.close()


async def test_an_agent_without_instructions_is_stored_as_one_without_a_system_turn(store: Store) -> None:
    await store.upsert_agent("bare", None, [], {})
    assert (await store.get_agent("bare")).instructions is None
    await store.upsert_agent("bare", "", [], {})  # an empty system turn is another thing
    assert (await store.get_agent("bare")).instructions == ""


async def test_agents_stored_before_migration_3_keep_their_system_turn(store_url: str, tmp_path: Path) -> None:
    engine = create_engine(store_url)
    with engine.begin() as conn:
        schema_at(conn, 2)
        conn.execute(text("INSERT INTO agents (name, instructions, tool_names, settings, updated_at) "
                          "VALUES ('old', 'Be kind.', '[]', '{}', :now)"), {"now": utcnow().replace(tzinfo=None)})
    engine.dispose()
    upgraded = Store(store_url, snapshot_dir=tmp_path / "s")
    assert (await upgraded.get_agent("old")).instructions == "Be kind."
    await upgraded.close()
