"""Store's schema on real SQLite files (and PostgreSQL when AGENTKV_TEST_POSTGRES_URL is set): a
newer schema is refused, stores opening one fresh database at once all succeed, the migrations
build what the ORM declares, and rows an old schema stored read as they were meant."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from sqlalchemy import create_engine, insert, inspect, text

from _old_schema import old_agent, schema_at
from _stores import new_session

from agentkv.errors import SchemaVersionError
from agentkv.memory import Store
from agentkv.memory.migrations import LATEST_VERSION, MIGRATIONS, schema_version
from agentkv.memory.schema import Base, utcnow


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
