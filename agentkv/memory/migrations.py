"""Numbered schema migrations and the ``schema_version`` table that records which ran.

``migrate(engine)`` brings a database up to ``LATEST_VERSION`` in one transaction and
refuses (``SchemaVersionError``) a database written by a newer agentkv. Each migration is
frozen once released: it spells out its own DDL in SQLAlchemy Core instead of reading the
ORM classes, so a fresh database and an upgraded one end up with the same tables. To change
the schema, append a migration and update ``schema.py`` to match (a test compares them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    func,
    insert,
    select,
    text,
)
from sqlalchemy.engine import Connection, Engine

from agentkv.errors import SchemaVersionError
from agentkv.memory.schema import utcnow

_version_metadata = MetaData()
schema_version = Table(
    "schema_version",
    _version_metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("name", String(255), nullable=False),
    Column("applied_at", DateTime, nullable=False),  # naive UTC
)

# Any constant works: it names the PostgreSQL advisory lock that serialises migrations.
_PG_MIGRATION_LOCK = 0x61676B76


@dataclass(frozen=True)
class Migration:
    """One schema step: ``apply`` runs inside the migration transaction."""

    version: int
    name: str
    apply: Callable[[Connection], None]


def _m001_initial(conn: Connection) -> None:
    """1: agents, sessions (with a lease), append-only messages, KV snapshot metadata."""
    md = MetaData()
    Table(
        "agents", md,
        Column("name", String(255), primary_key=True),
        Column("instructions", Text, nullable=False),
        Column("tool_names", JSON, nullable=False),
        Column("settings", JSON, nullable=False),
        Column("updated_at", DateTime, nullable=False),
    )
    Table(
        "sessions", md,
        Column("id", String(255), primary_key=True),
        Column("agent_name", String(255), ForeignKey("agents.name"), nullable=False, index=True),
        Column("created_at", DateTime, nullable=False),
        Column("updated_at", DateTime, nullable=False),
        Column("lease_holder", String(255)),
        Column("lease_expires_at", DateTime),
        Column("metadata", JSON, nullable=False),
    )
    # Messages are keyed by (session, seq); rows are appended and never rewritten, except
    # for in_window / replaced_by_seq when a context policy moves them out of the window.
    Table(
        "messages", md,
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"),
               primary_key=True),
        Column("seq", Integer, primary_key=True, autoincrement=False),
        Column("role", String(16), nullable=False),
        Column("content", Text, nullable=False),
        Column("tool_calls", JSON, nullable=False),
        Column("tool_call_id", String(255)),
        Column("name", String(255)),
        Column("token_ids", JSON),
        Column("token_count", Integer, nullable=False),
        Column("in_window", Boolean, nullable=False),
        Column("replaced_by_seq", Integer),
        Column("created_at", DateTime, nullable=False),
    )
    # Only metadata lives here: the tensors are in files beside the database.
    Table(
        "kv_snapshots", md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"),
               nullable=False, index=True),
        Column("num_tokens", Integer, nullable=False),
        Column("token_hash", String(64), nullable=False),
        Column("fingerprint", Text, nullable=False),
        Column("precision", String(8), nullable=False),
        Column("path", Text, nullable=False),
        Column("checksum", String(128), nullable=False),
        Column("nbytes", BigInteger, nullable=False),
        Column("shifted", Boolean, nullable=False),
        Column("created_at", DateTime, nullable=False),
    )
    md.create_all(conn)


def _m002_sessions_by_recency(conn: Connection) -> None:
    """2: index sessions.updated_at, the order ``list_sessions`` returns them in."""
    md = MetaData()
    sessions = Table("sessions", md, Column("updated_at", DateTime))
    Index("ix_sessions_updated_at", sessions.c.updated_at).create(conn)


def _m003_agents_without_system_turn(conn: Connection) -> None:
    """3: agents.system_turn — False for ``Agent(instructions=None)`` (no system turn: the chat
    template's own default applies). Existing agents keep theirs."""
    # NOTE: ADD COLUMN (SQLite cannot make instructions nullable in place); TRUE is spelled the
    # same in SQLite (3.23+) and PostgreSQL
    conn.execute(text("ALTER TABLE agents ADD COLUMN system_turn BOOLEAN NOT NULL DEFAULT TRUE"))


def _m004_responses(conn: Connection) -> None:
    """4: responses — API responses kept for retrieval and chaining (``previous_response_id``),
    each pointing at the session it continued and the newest message it covered."""
    md = MetaData()
    Table("sessions", md, Column("id", String(255), primary_key=True))
    Table(
        "responses", md,
        Column("id", String(64), primary_key=True),
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"),
               nullable=False, index=True),
        Column("owner", String(64), nullable=False),
        Column("last_seq", Integer, nullable=False),
        Column("body", JSON, nullable=False),
        Column("created_at", DateTime, nullable=False),
    )
    md.tables["responses"].create(conn)


def _m005_branches(conn: Connection) -> None:
    """5: branches — sessions.parent_id / fork_seq (a fork shares its parent's messages up to
    fork_seq, without copying them), messages.out_since_seq (the session's newest seq when a
    message left the window, so a fork sees the window as it was at its fork point) and
    branch_marks (a fork's own window marks on the messages it shares)."""
    conn.execute(text("ALTER TABLE sessions ADD COLUMN parent_id VARCHAR(255) REFERENCES sessions (id)"))
    conn.execute(text("ALTER TABLE sessions ADD COLUMN fork_seq INTEGER"))
    conn.execute(text("CREATE INDEX ix_sessions_parent_id ON sessions (parent_id)"))
    conn.execute(text("ALTER TABLE messages ADD COLUMN out_since_seq INTEGER"))
    md = MetaData()
    Table("sessions", md, Column("id", String(255), primary_key=True))
    Table(
        "branch_marks", md,
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        Column("seq", Integer, primary_key=True, autoincrement=False),
        Column("replaced_by_seq", Integer),
        Column("out_since_seq", Integer, nullable=False),
    )
    md.tables["branch_marks"].create(conn)


def _m006_calls(conn: Connection) -> None:
    """6: calls — one row per model call of a stored session: its token counts, timings, KV size,
    and the cache break and compaction before it (``agentkv sessions show ID --kv``)."""
    md = MetaData()
    Table("sessions", md, Column("id", String(255), primary_key=True))
    Table(
        "calls", md,
        Column("id", Integer, primary_key=True, autoincrement=True),
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"),
               nullable=False, index=True),
        Column("prompt_tokens", Integer, nullable=False),
        Column("reused_tokens", Integer, nullable=False),
        Column("prefix_cache_tokens", Integer, nullable=False),
        Column("prefilled_tokens", Integer, nullable=False),
        Column("generated_tokens", Integer, nullable=False),
        Column("ttft_s", Float, nullable=False),
        Column("tpot_s", Float, nullable=False),
        Column("kv_tokens", Integer, nullable=False),
        Column("kv_bytes", BigInteger, nullable=False),
        Column("cache_break", JSON),
        Column("compaction", JSON),
        Column("created_at", DateTime, nullable=False),
    )
    md.tables["calls"].create(conn)


def _m007_lease_epoch(conn: Connection) -> None:
    """7: sessions.lease_epoch — the fencing token of the session's lease, counted up each time
    the lease passes to another holder; a write carrying an older one is refused, so a holder
    that lost its lease cannot write after the next one did."""
    conn.execute(text("ALTER TABLE sessions ADD COLUMN lease_epoch INTEGER NOT NULL DEFAULT 0"))


def _m008_message_reasoning(conn: Connection) -> None:
    """8: messages.reasoning — a reasoning model's thinking, kept apart from the answer's
    content (NULL for every message before: none had any)."""
    conn.execute(text("ALTER TABLE messages ADD COLUMN reasoning TEXT"))


DECODE_COLUMNS = ("forced_tokens", "drafted_tokens", "accepted_tokens", "steps_saved")
"""The ``calls`` columns migration 9 adds (``GenerationMetrics``' figures of the same names)."""


def _m009_call_decode_figures(conn: Connection) -> None:
    """9: calls.forced_tokens / drafted_tokens / accepted_tokens / steps_saved — what grammar
    fast-forward and prompt-lookup drafts did in each model call. NULL for every call before:
    "not recorded", not 0 — calls made since fast-forward landed (issue 27, step 1) forced
    tokens that no column kept. Nullable columns without a default: one ALTER each, the same on
    SQLite and PostgreSQL, and no rewrite of the table."""
    for name in DECODE_COLUMNS:
        conn.execute(text(f"ALTER TABLE calls ADD COLUMN {name} INTEGER"))


def _m010_window_moves(conn: Connection) -> None:
    """10: window_moves — every move of a message into or out of a session's window, numbered by
    that session's sessions.window_version; sessions.fork_version (the parent's version at the fork)
    and messages.window_version (the session's version when the message came). Schema 5 told a
    fork's window by seqs and updated the shared rows in place, so a parent's rewind changed its
    forks' windows (issue 45); now a fork reads its ancestors' moves up to its fork point only.

    Existing windows read as they did: each message out of a window (a row of its session, or a
    branch_marks row of a fork) becomes one move whose version is the seq schema 5 compared —
    max(out_since_seq, replaced_by_seq), 0 when both are NULL —, a fork's fork_version is its
    fork_seq, a message's window_version its seq - 1 (so a fork at an earlier seq reads as of
    that seq, as before), and a session's window_version its newest seq, so that its later moves
    come after all of these. branch_marks goes; messages.out_since_seq stays, unused (dropping a
    column needs SQLite 3.35)."""
    conn.execute(text("ALTER TABLE sessions ADD COLUMN window_version INTEGER NOT NULL DEFAULT 0"))
    conn.execute(text("ALTER TABLE sessions ADD COLUMN fork_version INTEGER"))
    conn.execute(text("ALTER TABLE messages ADD COLUMN window_version INTEGER NOT NULL DEFAULT 0"))
    md = MetaData()
    Table("sessions", md, Column("id", String(255), primary_key=True))
    Table(
        "window_moves", md,
        Column("session_id", String(255), ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True),
        Column("version", Integer, primary_key=True, autoincrement=False),
        Column("seq", Integer, primary_key=True, autoincrement=False),
        Column("in_window", Boolean, nullable=False),
        Column("replaced_by_seq", Integer),
    )
    md.tables["window_moves"].create(conn)
    # NOTE: CASE, not max() / GREATEST(): the one spelling SQLite and PostgreSQL share
    since = ("CASE WHEN COALESCE(out_since_seq, 0) > COALESCE(replaced_by_seq, 0) "
             "THEN COALESCE(out_since_seq, 0) ELSE COALESCE(replaced_by_seq, 0) END")
    conn.execute(text(f"INSERT INTO window_moves (session_id, version, seq, in_window, replaced_by_seq) "
                      f"SELECT session_id, {since}, seq, FALSE, replaced_by_seq FROM messages WHERE NOT in_window"))
    conn.execute(text(f"INSERT INTO window_moves (session_id, version, seq, in_window, replaced_by_seq) "
                      f"SELECT session_id, {since}, seq, FALSE, replaced_by_seq FROM branch_marks"))
    conn.execute(text("DROP TABLE branch_marks"))
    conn.execute(text("UPDATE messages SET window_version = seq - 1"))
    conn.execute(text("UPDATE sessions SET fork_version = fork_seq"))
    newest = "(SELECT COALESCE(MAX(seq), 0) FROM messages WHERE messages.session_id = sessions.id)"
    conn.execute(text(f"UPDATE sessions SET window_version = CASE WHEN COALESCE(fork_seq, 0) > {newest} "
                      f"THEN fork_seq ELSE {newest} END"))


def _m011_past_reasoning_auto(conn: Connection) -> None:
    """11: an agent row's ``past_reasoning`` "shift" becomes "auto", the new default. Rows written
    before it always held "shift" (then the default), chosen or not; kept, they would make an agent
    resumed from its row shift earlier thinking on an exact engine, whose KV must stay bit-exact.
    "auto" still shifts on every other engine; "reprefill" rows stay as they are."""
    agents = Table("agents", MetaData(), Column("name", String(255), primary_key=True), Column("settings", JSON))
    for name, settings in conn.execute(select(agents.c.name, agents.c.settings)).all():
        if isinstance(settings, dict) and settings.get("past_reasoning") == "shift":
            conn.execute(agents.update().where(agents.c.name == name)
                         .values(settings={**settings, "past_reasoning": "auto"}))


BLOCK_COLUMNS = (("block_keys", "TEXT"), ("block_size", "INTEGER"), ("kv_namespace", "VARCHAR(32)"))
"""The ``kv_snapshots`` columns migration 12 adds."""


def _m012_snapshot_blocks(conn: Connection) -> None:
    """12: kv_snapshots.block_keys / block_size / kv_namespace — a snapshot saved as keyed blocks
    shared between turns and conversations (issue 46) names them here, and its file keeps only the
    tail after them. NULL for every snapshot before: its file holds the whole KV and still restores."""
    for name, kind in BLOCK_COLUMNS:
        conn.execute(text(f"ALTER TABLE kv_snapshots ADD COLUMN {name} {kind}"))


def _m013_prompt_blocks(conn: Connection) -> None:
    """13: kv_prompt_blocks — keyed blocks found by the tokens they hold (namespace, token_key,
    block_key, parent_key, used_at): the KV of conversations sent whole (chat completions), which
    have no session row, for any replica to restore; kv_answer_tokens — the token ids of the answers
    in them, so another replica renders a resent answer to the tokens its KV holds."""
    md = MetaData()
    Table(
        "kv_prompt_blocks", md,
        Column("namespace", String(32), primary_key=True),
        Column("token_key", String(32), primary_key=True),
        Column("block_key", String(32), primary_key=True),
        Column("parent_key", String(32), nullable=False),
        Column("used_at", DateTime, nullable=False),
    )
    md.tables["kv_prompt_blocks"].create(conn)
    Table(
        "kv_answer_tokens", md,
        Column("answer_key", String(64), primary_key=True),
        Column("token_ids", JSON, nullable=False),
        Column("used_at", DateTime, nullable=False),
    )
    md.tables["kv_answer_tokens"].create(conn)


CONVERSATION_TABLES = ("messages", "window_moves", "kv_snapshots", "responses", "calls")
"""The tables whose ``session_id`` column migration 14 renames ``conversation_id``."""


def _m014_conversations(conn: Connection) -> None:
    """14: the stored thing a user opens, runs and resumes is a conversation (issue 48): table
    ``sessions`` becomes ``conversations`` and every ``session_id`` column ``conversation_id``, with
    their indexes renamed to the names the ORM declares. Rows, keys and foreign keys stay (SQLite
    >= 3.26 and PostgreSQL carry references across a rename)."""
    conn.execute(text("ALTER TABLE sessions RENAME TO conversations"))
    for old in ("agent_name", "parent_id", "updated_at"):
        conn.execute(text(f"DROP INDEX ix_sessions_{old}"))
        conn.execute(text(f"CREATE INDEX ix_conversations_{old} ON conversations ({old})"))
    for table in CONVERSATION_TABLES:
        conn.execute(text(f"ALTER TABLE {table} RENAME COLUMN session_id TO conversation_id"))
    for table in ("kv_snapshots", "responses", "calls"):
        conn.execute(text(f"DROP INDEX ix_{table}_session_id"))
        conn.execute(text(f"CREATE INDEX ix_{table}_conversation_id ON {table} (conversation_id)"))


MIGRATIONS: tuple[Migration, ...] = (
    Migration(1, "initial", _m001_initial),
    Migration(2, "sessions_by_recency", _m002_sessions_by_recency),
    Migration(3, "agents_without_system_turn", _m003_agents_without_system_turn),
    Migration(4, "responses", _m004_responses),
    Migration(5, "branches", _m005_branches),
    Migration(6, "calls", _m006_calls),
    Migration(7, "lease_epoch", _m007_lease_epoch),
    Migration(8, "message_reasoning", _m008_message_reasoning),
    Migration(9, "call_decode_figures", _m009_call_decode_figures),
    Migration(10, "window_moves", _m010_window_moves),
    Migration(11, "past_reasoning_auto", _m011_past_reasoning_auto),
    Migration(12, "snapshot_blocks", _m012_snapshot_blocks),
    Migration(13, "prompt_blocks", _m013_prompt_blocks),
    Migration(14, "conversations", _m014_conversations),
)
LATEST_VERSION = MIGRATIONS[-1].version


def current_version(conn: Connection) -> int:
    """The highest applied migration, 0 for an empty database."""
    if not conn.dialect.has_table(conn, schema_version.name):
        return 0
    return int(conn.execute(select(func.max(schema_version.c.version))).scalar() or 0)


def migrate(engine: Engine) -> int:
    """Apply every pending migration in one transaction; return the resulting version.

    ``engine`` should begin write transactions (SQLite: ``BEGIN IMMEDIATE``), so that two
    processes opening a fresh database do not both create it. Raises ``SchemaVersionError``
    if the database is newer than this code.
    """
    with engine.begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _PG_MIGRATION_LOCK})
        found = current_version(conn)
        if found > LATEST_VERSION:
            raise SchemaVersionError(
                f"the database {engine.url.render_as_string(hide_password=True)} has schema "
                f"version {found}, newer than {LATEST_VERSION} which this agentkv understands; "
                "upgrade agentkv (or point AGENTKV_DB_URL at another database)"
            )
        _version_metadata.create_all(conn)
        for step in MIGRATIONS[found:]:
            step.apply(conn)
            conn.execute(insert(schema_version).values(
                version=step.version, name=step.name, applied_at=utcnow().replace(tzinfo=None)
            ))
    return LATEST_VERSION
