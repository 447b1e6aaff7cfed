"""Databases as an older agentkv left them, for the migration tests: the schema of migrations
1..N, each recorded as applied, and the agent and session rows each test puts in after it::

    with engine.begin() as conn:
        schema_at(conn, 9)
        old_agent(conn, "old", instructions="Be kind.")
        old_session(conn, "s1", "old", parent_id=None, fork_seq=None)
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import insert, text
from sqlalchemy.engine import Connection

from agentkv.memory.migrations import MIGRATIONS, schema_version
from agentkv.memory.schema import utcnow


def schema_at(conn: Connection, version: int) -> None:
    """Create the schema as migrations 1..``version`` made it, each recorded as applied."""
    now = old_now()
    schema_version.metadata.create_all(conn)
    for step in MIGRATIONS[:version]:
        step.apply(conn)
        conn.execute(insert(schema_version).values(version=step.version, name=step.name, applied_at=now))


def old_now() -> datetime:
    """Now, as the old schemas' naive UTC timestamp columns hold it."""
    return utcnow().replace(tzinfo=None)


def old_agent(conn: Connection, name: str, instructions: str = "") -> None:
    """An agent row with no tools and no settings, in the columns every schema version has:
    ``old_agent(conn, "old", instructions="Be kind.")``."""
    conn.execute(text("INSERT INTO agents (name, instructions, tool_names, settings, updated_at) "
                      "VALUES (:name, :instructions, '[]', '{}', :now)"),
                 {"name": name, "instructions": instructions, "now": old_now()})


def old_session(conn: Connection, session_id: str, agent: str, **columns: Any) -> None:
    """A session row of ``agent`` with no metadata, plus the columns of its schema version that
    a test sets (``parent_id``, ``fork_seq``, ``lease_epoch``…):
    ``old_session(conn, "s1", "old", lease_epoch=0)``."""
    names = ["id", "agent_name", "created_at", "updated_at", "metadata", *columns]
    values = [":id", ":agent", ":now", ":now", "'{}'", *(f":{name}" for name in columns)]
    conn.execute(text(f"INSERT INTO sessions ({', '.join(names)}) VALUES ({', '.join(values)})"),
                 {"id": session_id, "agent": agent, "now": old_now(), **columns})
