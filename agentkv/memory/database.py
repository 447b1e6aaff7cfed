"""Database connections: default URL, SQLite settings (WAL, busy timeout, foreign keys), retries.

``engine = create_db_engine("sqlite:///agentkv.db")``; transactions on
``engine.execution_options(agentkv_write=True)`` take SQLite's write lock when they begin
(``BEGIN IMMEDIATE``), so read-then-write transactions never fail half-way on a lock upgrade.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import platformdirs
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import StaticPool
from tenacity import (RetryCallState, Retrying, retry_if_exception, stop_after_attempt,
                      wait_exponential)

from agentkv.errors import StoreLocked

T = TypeVar("T")

APP_NAME = "agentkv"
BUSY_TIMEOUT_MS = 10_000
"""How long SQLite waits on another connection's lock before reporting "database is locked"."""
RETRY_ATTEMPTS = 5
"""Transactions that still fail on a lock (or a PostgreSQL deadlock) are retried this often."""
WRITE_OPTION = "agentkv_write"
"""Execution option that marks an engine whose transactions write."""

_SQLITE_LOCK_MESSAGES = ("database is locked", "database table is locked", "database is busy")
_PG_RETRYABLE_CODES = {"40001", "40P01"}  # serialization failure, deadlock detected


ENV_HOME = "AGENTKV_HOME"
"""Root of the default database (``<home>/agentkv.db``) and of KV snapshots (``<home>/snapshots``)."""


def data_root() -> Path:
    """``$AGENTKV_HOME`` if set, else the user data directory (``~/.local/share/agentkv`` on Linux)."""
    home = os.environ.get(ENV_HOME)
    return Path(home).expanduser().absolute() if home else Path(platformdirs.user_data_dir(APP_NAME))


def default_url() -> str:
    """``sqlite:///<data root>/agentkv.db`` (the directory is created on use; see ``data_root``)."""
    return f"sqlite:///{data_root() / 'agentkv.db'}"


def sqlite_file(url: URL) -> Path | None:
    """The database file of a SQLite URL; None for in-memory SQLite or another backend."""
    if url.get_backend_name() != "sqlite":
        return None
    database = url.database or ""
    if database in ("", ":memory:") or database.startswith("file:"):
        return None
    return Path(database).expanduser().resolve()


def default_snapshot_dir(url: URL) -> Path:
    """``<db dir>/snapshots`` for a SQLite file, otherwise ``<data root>/snapshots``."""
    db_file = sqlite_file(url)
    base = db_file.parent if db_file is not None else data_root()
    return base / "snapshots"


def is_memory_sqlite(url: URL) -> bool:
    return url.get_backend_name() == "sqlite" and sqlite_file(url) is None


def create_db_engine(url: str | URL) -> Engine:
    """An engine for ``url``; SQLite gets WAL, busy_timeout, foreign keys and explicit BEGINs."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(parsed, pool_pre_ping=True)
    db_file = sqlite_file(parsed)
    if db_file is None:
        # One shared connection, so every thread sees the same in-memory database.
        engine = create_engine(parsed, poolclass=StaticPool,
                               connect_args={"check_same_thread": False})
    else:
        db_file.parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(parsed, connect_args={"timeout": BUSY_TIMEOUT_MS / 1000})
    _configure_sqlite(engine, wal=db_file is not None)
    return engine


def _configure_sqlite(engine: Engine, *, wal: bool) -> None:
    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # NOTE: pysqlite's own transaction handling issues a deferred BEGIN lazily before DML
        # only; turning it off lets the "begin" hook below choose BEGIN or BEGIN IMMEDIATE.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        if wal:
            cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        writes = connection.get_execution_options().get(WRITE_OPTION, False)
        connection.exec_driver_sql("BEGIN IMMEDIATE" if writes else "BEGIN")


def is_retryable(error: BaseException) -> bool:
    """True for SQLite lock timeouts and PostgreSQL deadlocks / serialization failures."""
    if not isinstance(error, DBAPIError):
        return False
    if getattr(error.orig, "pgcode", None) in _PG_RETRYABLE_CODES:
        return True
    message = str(error.orig).lower()
    return any(text in message for text in _SQLITE_LOCK_MESSAGES)


def retry_locked(work: Callable[[], T], *, attempts: int = RETRY_ATTEMPTS,
                 first_delay_s: float = 0.05) -> T:
    """Run ``work`` (one whole transaction) again on a lock error, with backoff, a bounded number of times.

    ``retry_locked(lambda: write_row(...))``; waits ``first_delay_s``, doubled after each attempt;
    raises ``StoreLocked`` after the last attempt, and any other error at once.
    """
    return Retrying(
        retry=retry_if_exception(is_retryable),
        stop=stop_after_attempt(attempts),
        wait=wait_exponential(multiplier=first_delay_s),
        retry_error_callback=_still_locked,
    )(work)


def _still_locked(state: RetryCallState) -> NoReturn:
    """tenacity calls this after the last attempt: ``StoreLocked``, chained from the lock error."""
    error = state.outcome.exception() if state.outcome is not None else None
    raise StoreLocked(
        f"the database stayed locked through {state.attempt_number} attempts "
        f"({getattr(error, 'orig', error)}); another process holds a long transaction: retry "
        "later, or use PostgreSQL for many writers (AGENTKV_DB_URL)"
    ) from error
