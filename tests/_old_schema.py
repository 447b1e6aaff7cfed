"""Databases as an older agentkv left them, for the migration tests: the schema of migrations
1..N, each recorded as applied (the rows each test needs go in after it)::

    with engine.begin() as conn:
        schema_at(conn, 9)
"""

from __future__ import annotations

from sqlalchemy import insert
from sqlalchemy.engine import Connection

from agentkv.memory.migrations import MIGRATIONS, schema_version
from agentkv.memory.schema import utcnow


def schema_at(conn: Connection, version: int) -> None:
    """Create the schema as migrations 1..``version`` made it, each recorded as applied."""
    now = utcnow().replace(tzinfo=None)
    schema_version.metadata.create_all(conn)
    for step in MIGRATIONS[:version]:
        step.apply(conn)
        conn.execute(insert(schema_version).values(version=step.version, name=step.name, applied_at=now))
