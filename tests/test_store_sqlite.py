"""Store on SQLite only (no PostgreSQL variant): lock waits and bounded retries, the URL from the
environment, and an in-memory database under concurrent use."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import anyio
import pytest
from sqlalchemy.exc import OperationalError

from _stores import make_snapshot, new_conversation

from agentkv.chat.messages import Message
from agentkv.errors import StoreLocked
from agentkv.memory import Store
from agentkv.memory.database import retry_locked


async def test_a_write_waits_for_another_connections_lock(tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    sid = await new_conversation(store)
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
    sid = await new_conversation(store)
    record = await store.save_snapshot(sid, make_snapshot(2))
    assert (tmp_path / "env.db").exists()
    assert record.path.parent == tmp_path / "snapshots"
    await store.close()


async def test_an_in_memory_database_supports_concurrent_use(tmp_path: Path) -> None:
    store = Store("sqlite://", snapshot_dir=tmp_path / "snaps")
    sid = await new_conversation(store)
    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(lambda i=i: store.append_message(sid, Message.user(str(i)),
                                                           token_count=1))
    assert [m.seq for m in await store.messages(sid)] == list(range(1, 11))
    await store.close()
