"""Database connections: default URL, SQLite settings (WAL, busy timeout, foreign keys), retries,
and ``Database``, which runs the store's transactions in worker threads.

``engine = create_db_engine("sqlite:///agentkv.db")``; transactions on
``engine.execution_options(agentkv_write=True)`` take SQLite's write lock when they begin
(``BEGIN IMMEDIATE``), so read-then-write transactions never fail half-way on a lock upgrade.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import anyio.to_thread
import platformdirs
from sqlalchemy import create_engine, event
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, DBAPIError, OperationalError
from sqlalchemy.orm import Session
from sqlalchemy.pool import StaticPool
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_attempt,
    wait_exponential,
)

from agentkv.errors import StoreLocked, StoreUnavailable, UserError
from agentkv.memory.migrations import migrate

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


class Database:
    """One database: its engines, the schema created or upgraded on first use, and transactions.

    ``db = Database("sqlite:////tmp/a.db")``; ``await db.run(db.write, lambda s: s.add(row))``
    commits one write transaction from a worker thread; ``db.read(work)`` in that thread reads.
    """

    def __init__(self, url: str | None = None) -> None:
        """``UserError`` for a malformed URL or a missing driver; ``StoreUnavailable`` when a SQLite
        file's directory cannot be created."""
        try:
            self.parsed_url = make_url(url or default_url())
            """The URL as given (password included): where snapshot files default to."""
        except ArgumentError as error:
            raise UserError(f"{url!r} is not a database URL: pass a SQLAlchemy URL such as "
                            "sqlite:////path/to/agentkv.db or postgresql://user@host/db") from error
        self.url = self.parsed_url.render_as_string(hide_password=True)
        """The database URL for display (password hidden)."""
        try:
            self.engine = create_db_engine(self.parsed_url)
            """The SQLAlchemy engine reads go through (writes use the same pool)."""
        except OSError as error:  # the SQLite file's directory cannot be created
            raise StoreUnavailable(self.url, error) from error
        except (ArgumentError, ImportError) as error:  # a dialect or its driver not installed
            raise UserError(f"cannot open {self.url}: {error}; use sqlite:// or postgresql:// (with "
                            "psycopg2 installed), or install the driver this URL names") from error
        self._write_engine = self.engine.execution_options(**{WRITE_OPTION: True})
        self._schema_lock = threading.Lock()
        self._schema_ready = False
        # SQLite admits one writer at a time: queueing this process's writers on a lock is
        # faster than letting them poll SQLite's busy handler. An in-memory database shares
        # one connection, so there every transaction takes the lock.
        is_sqlite = self.parsed_url.get_backend_name() == "sqlite"
        self._writer_lock: threading.Lock | None = threading.Lock() if is_sqlite else None
        self._reader_lock = self._writer_lock if is_memory_sqlite(self.parsed_url) else None

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a worker thread once the schema is ready: ``await db.run(db.read, work)``;
        a database that cannot be used (read-only, disk full, unreachable) is ``StoreUnavailable``."""
        return await anyio.to_thread.run_sync(partial(self._in_thread, fn, *args))

    def _in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            self._ensure_schema()
            return fn(*args)
        except OperationalError as error:  # read-only, disk full, I/O error, unreachable
            raise StoreUnavailable(self.url, error) from error

    def _ensure_schema(self) -> None:
        if self._schema_ready:
            return
        with self._schema_lock, _locked(self._writer_lock):
            if not self._schema_ready:
                retry_locked(lambda: migrate(self._write_engine))
                self._schema_ready = True

    def write(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in one write transaction (committed on return, retried on lock errors):
        ``db.write(lambda s: s.add(row))``, in a worker thread."""
        def attempt() -> T:
            with _locked(self._writer_lock), Session(self._write_engine, expire_on_commit=False) as s:
                with s.begin():
                    return work(s)
        return retry_locked(attempt)

    def read(self, work: Callable[[Session], T]) -> T:
        """Run ``work`` in one read transaction (retried on lock errors): ``db.read(queries.list_conversations)``."""
        def attempt() -> T:
            with _locked(self._reader_lock), Session(self.engine) as s, s.begin():
                return work(s)
        return retry_locked(attempt)

    async def dispose(self) -> None:
        """Close pooled connections; the database can still be used afterwards (it reconnects)."""
        await anyio.to_thread.run_sync(self.engine.dispose)


def _locked(lock: threading.Lock | None) -> AbstractContextManager[Any]:
    return lock if lock is not None else nullcontext()
