"""Store's schema on real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set): a
newer schema is refused, stores opening one fresh database at once all succeed, the migrations
build what the ORM declares, and rows an old schema stored read as they were meant."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest
from sqlalchemy import create_engine, insert, inspect, text

from _old_schema import old_agent, old_session, schema_at
from _stores import new_conversation

from agentkv.errors import SchemaVersionError
from agentkv.memory import Store
from agentkv.memory.migrations import LATEST_VERSION, MIGRATIONS, schema_version
from agentkv.memory.schema import Base, utcnow

DATA = Path(__file__).parent / "data"


async def test_a_database_from_a_newer_schema_is_refused(store: Store, store_url: str,
                                                         tmp_path: Path) -> None:
    await new_conversation(store)  # creates the schema
    engine = create_engine(store_url)
    with engine.begin() as conn:
        conn.execute(insert(schema_version).values(version=LATEST_VERSION + 1, name="future",
                                                   applied_at=utcnow().replace(tzinfo=None)))
    engine.dispose()
    newer = Store(store_url, snapshot_dir=tmp_path / "s")
    with pytest.raises(SchemaVersionError, match="upgrade agentkv"):
        await newer.list_conversations()
    await newer.close()


async def test_stores_opening_one_fresh_database_at_once_all_succeed(store_url: str,
                                                                     tmp_path: Path) -> None:
    stores = [Store(store_url, snapshot_dir=tmp_path / "s") for _ in range(3)]
    async with anyio.create_task_group() as tg:
        for opened in stores:
            tg.start_soon(opened.list_conversations)
    engine = create_engine(store_url)
    with engine.connect() as conn:
        applied = conn.execute(text("SELECT version FROM schema_version ORDER BY version")).all()
    engine.dispose()
    assert [v for (v,) in applied] == list(range(1, LATEST_VERSION + 1))
    for opened in stores:
        await opened.close()


async def test_migrations_build_the_tables_the_orm_declares(store: Store, store_url: str) -> None:
    await store.list_conversations()  # runs the migrations
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


async def test_agents_stored_before_migration_3_keep_their_system_turn(store_url: str, tmp_path: Path) -> None:
    engine = create_engine(store_url)
    with engine.begin() as conn:
        schema_at(conn, 2)
        old_agent(conn, "old", instructions="Be kind.")
    engine.dispose()
    upgraded = Store(store_url, snapshot_dir=tmp_path / "s")
    assert (await upgraded.get_agent("old")).instructions == "Be kind."
    await upgraded.close()


async def test_a_store_written_at_schema_13_reads_as_conversations_after_migration_14(tmp_path: Path) -> None:
    # tests/data/store_schema13.sqlite was written by the store of schema 13 (table ``sessions``,
    # columns ``session_id``): two conversations (one a fork), messages, a window move, a call, a response
    db = tmp_path / "old.sqlite"
    shutil.copy(DATA / "store_schema13.sqlite", db)
    store = Store(f"sqlite:///{db}", snapshot_dir=tmp_path / "s")
    assert sorted(c.id for c in await store.list_conversations()) == ["conv-fork", "conv-old"]
    fork = await store.get_conversation("conv-fork")
    assert (fork.parent_id, fork.fork_seq) == ("conv-old", 2)
    seen = [(m.conversation_id, m.seq, m.message.content, m.in_window) for m in await store.messages("conv-fork")]
    assert seen == [("conv-old", 1, "Hi", True), ("conv-old", 2, "Hello!", True),  # as of its fork point
                    ("conv-fork", 3, "Another question", True)]
    assert [m.in_window for m in await store.messages("conv-old")] == [False, True, True, True]
    [call] = await store.calls("conv-old")
    assert (call.conversation_id, call.prompt_tokens, call.kv_bytes) == ("conv-old", 9, 1024)
    [response] = await store.responses("conv-old")
    assert (response.id, response.conversation_id, response.owner) == ("resp_old", "conv-old", "tenant-a")
    await store.delete_conversation("conv-fork")  # the foreign keys still cascade after the renames
    assert [c.id for c in await store.list_conversations()] == ["conv-old"]
    await store.close()
    engine = create_engine(f"sqlite:///{db}")
    inspector = inspect(engine)
    assert "sessions" not in inspector.get_table_names()
    for table in Base.metadata.sorted_tables:
        assert {index.name for index in table.indexes} <= {i["name"] for i in inspector.get_indexes(table.name)}
    engine.dispose()


async def test_a_conversation_stored_at_schema_13_opens_after_migration_14_on_every_database(
        store_url: str, tmp_path: Path) -> None:
    engine = create_engine(store_url)
    with engine.begin() as conn:
        schema_at(conn, 13)
        old_agent(conn, "old")
        old_session(conn, "s1", "old", lease_epoch=0)
    engine.dispose()
    upgraded = Store(store_url, snapshot_dir=tmp_path / "s")
    assert (await upgraded.get_conversation("s1")).agent_name == "old"
    assert [c.id for c in await upgraded.list_conversations()] == ["s1"]
    await upgraded.close()
