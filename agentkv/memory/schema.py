"""The store's tables as SQLAlchemy 2 ORM classes (the current shape; migrations build it).

Rows never leave ``agentkv.memory``: ``store.py`` turns them into the records of ``records.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    true,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator


def utcnow() -> datetime:
    """The current time, timezone-aware UTC."""
    return datetime.now(timezone.utc)


Clock = Callable[[], datetime]
"""What reads the time for leases: ``utcnow`` unless a test passes ``Store(clock=FakeClock())``."""


class UTCDateTime(TypeDecorator[datetime]):
    """Aware UTC datetimes in Python, naive UTC in the database (same on SQLite and PostgreSQL)."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("store datetimes must be timezone-aware; use datetime.now(timezone.utc)")
        return value.astimezone(timezone.utc).replace(tzinfo=None)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        return None if value is None else value.replace(tzinfo=timezone.utc)


class Base(DeclarativeBase):
    """Declarative base of the store's tables."""

    type_annotation_map = {datetime: UTCDateTime, dict[str, Any]: JSON, list[Any]: JSON}


class AgentRow(Base):
    __tablename__ = "agents"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)
    instructions: Mapped[str] = mapped_column(Text)
    system_turn: Mapped[bool] = mapped_column(server_default=true())
    """False: the agent renders no system turn (``instructions`` is then "")."""
    tool_names: Mapped[list[Any]] = mapped_column(JSON)
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    updated_at: Mapped[datetime]


class ConversationRow(Base):
    __tablename__ = "conversations"

    id: Mapped[str] = mapped_column(String(255), primary_key=True)
    agent_name: Mapped[str] = mapped_column(String(255), ForeignKey("agents.name"), index=True)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime] = mapped_column(index=True)
    lease_holder: Mapped[str | None] = mapped_column(String(255))
    lease_expires_at: Mapped[datetime | None]
    lease_epoch: Mapped[int] = mapped_column(Integer, server_default="0")
    """The lease's fencing token: counted up each time the lease passes to another holder."""
    # NOTE: "metadata" is reserved on declarative classes, so the attribute has another name.
    metadata_: Mapped[dict[str, Any]] = mapped_column("metadata", JSON)
    parent_id: Mapped[str | None] = mapped_column(String(255), ForeignKey("conversations.id"), index=True)
    """The conversation this one was forked from; it shares the parent's messages up to ``fork_seq``."""
    fork_seq: Mapped[int | None] = mapped_column(Integer)
    window_version: Mapped[int] = mapped_column(Integer, server_default="0")
    """How many window moves the conversation has made (schema 10): each move (a compaction, a truncation,
    a rewind) counts it up and is stored as ``window_moves`` rows of that version."""
    fork_version: Mapped[int | None] = mapped_column(Integer)
    """The parent's ``window_version`` at the fork point (schema 10): the fork sees the parent's
    window moves up to it and none after."""


class MessageRow(Base):
    """Append-only: content never changes. The window flags are the owning conversation's window now,
    kept in step with its ``window_moves`` (a fork reads those, never these)."""

    __tablename__ = "messages"

    conversation_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    tool_calls: Mapped[list[Any]] = mapped_column(JSON)
    tool_call_id: Mapped[str | None] = mapped_column(String(255))
    name: Mapped[str | None] = mapped_column(String(255))
    token_ids: Mapped[list[Any] | None] = mapped_column(JSON)
    reasoning: Mapped[str | None] = mapped_column(Text)
    """A reasoning model's thinking (``Message.reasoning``; schema 8)."""
    token_count: Mapped[int] = mapped_column(Integer)
    in_window: Mapped[bool] = mapped_column(Boolean)
    replaced_by_seq: Mapped[int | None] = mapped_column(Integer)
    created_at: Mapped[datetime]
    out_since_seq: Mapped[int | None] = mapped_column(Integer)
    """Schemas 5-9 only: the conversation's newest seq when the message left the window. Migration 10
    turned it into ``window_moves``; nothing writes or reads it since (NULL on newer rows)."""
    window_version: Mapped[int] = mapped_column(Integer, server_default="0")
    """The conversation's ``window_version`` when the message was appended (schema 10): a fork at the
    seq before this one sees the window as it was then."""


class WindowMoveRow(Base):
    """One message's move into or out of one conversation's window (append-only, schema 10): a fork
    reads its ancestors' moves up to its fork point and its own, so no conversation's move changes
    another's window."""

    __tablename__ = "window_moves"

    conversation_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("conversations.id", ondelete="CASCADE"), primary_key=True
    )
    """The conversation whose window changed (the message may be an ancestor's row it shares)."""
    version: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    """That conversation's ``window_version`` after the move (one version per compaction or rewind)."""
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    in_window: Mapped[bool] = mapped_column(Boolean)
    replaced_by_seq: Mapped[int | None] = mapped_column(Integer)
    """The summary that replaced the message (a move out by a compaction), else None."""


class SnapshotRow(Base):
    __tablename__ = "kv_snapshots"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    num_tokens: Mapped[int] = mapped_column(Integer)
    token_hash: Mapped[str] = mapped_column(String(64))
    fingerprint: Mapped[str] = mapped_column(Text)
    precision: Mapped[str] = mapped_column(String(8))
    path: Mapped[str] = mapped_column(Text)
    checksum: Mapped[str] = mapped_column(String(128))
    nbytes: Mapped[int] = mapped_column(BigInteger)
    shifted: Mapped[bool] = mapped_column(Boolean)
    created_at: Mapped[datetime]
    block_keys: Mapped[str | None] = mapped_column(Text, nullable=True, default=None)
    """Keyed blocks (``kv/block_keys.py``) holding the KV's full blocks, space-separated, oldest
    first; ``path`` then holds only the tail after them. NULL: ``path`` holds the whole KV."""
    block_size: Mapped[int | None] = mapped_column(Integer, nullable=True, default=None)
    """Tokens per block of ``block_keys`` (NULL with it)."""
    kv_namespace: Mapped[str | None] = mapped_column(String(32), nullable=True, default=None)
    """``KVNamespace.id`` the blocks were keyed in: the first block's parent (NULL with them)."""


class PromptBlockRow(Base):
    """A keyed block found by the tokens it holds: a conversation sent whole (chat completions)
    has no conversation row, so another replica finds its KV by its prompt's ``token_keys``."""

    __tablename__ = "kv_prompt_blocks"

    namespace: Mapped[str] = mapped_column(String(32), primary_key=True)
    """``KVNamespace.id`` (tenant, model, numerics, block size)."""
    token_key: Mapped[str] = mapped_column(String(32), primary_key=True)
    """``KVNamespace.token_keys(tokens)[i]``: the tokens of blocks 0..i."""
    block_key: Mapped[str] = mapped_column(String(32), primary_key=True)
    """The block holding block i's KV (one per way its tokens were computed)."""
    parent_key: Mapped[str] = mapped_column(String(32))
    """The block before it (the namespace's id for the first): a lookup follows one chain."""
    used_at: Mapped[datetime]
    """When a save last named it; rows unused for ``PROMPT_BLOCKS_KEPT`` are pruned."""


class AnswerTokensRow(Base):
    """The token ids of an answer the server generated, by its content: a conversation resent whole
    to another replica renders that answer to the very tokens its KV holds (a re-tokenised answer
    can differ)."""

    __tablename__ = "kv_answer_tokens"

    answer_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    """blake2b of the answer's content and calls (``server/live_sessions.py``'s answer key)."""
    token_ids: Mapped[list[Any]] = mapped_column(JSON)
    used_at: Mapped[datetime]


class ResponseRow(Base):
    """An API response kept for retrieval and chaining; its messages are the conversation's."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    conversation_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    owner: Mapped[str] = mapped_column(String(64))
    """Who may read it (the server's tenant namespace; "" when the server has no key)."""
    last_seq: Mapped[int] = mapped_column(Integer)
    """The conversation's newest message when the response was saved."""
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime]


class CallRow(Base):
    """One model call of a stored conversation: what it reused, computed and cost."""

    __tablename__ = "calls"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    conversation_id: Mapped[str] = mapped_column(
        String(255), ForeignKey("conversations.id", ondelete="CASCADE"), index=True
    )
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    reused_tokens: Mapped[int] = mapped_column(Integer)
    prefix_cache_tokens: Mapped[int] = mapped_column(Integer)
    prefilled_tokens: Mapped[int] = mapped_column(Integer)
    generated_tokens: Mapped[int] = mapped_column(Integer)
    ttft_s: Mapped[float] = mapped_column(Float)
    tpot_s: Mapped[float] = mapped_column(Float)
    kv_tokens: Mapped[int] = mapped_column(Integer)
    kv_bytes: Mapped[int] = mapped_column(BigInteger)
    cache_break: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    compaction: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime]
    forced_tokens: Mapped[int | None] = mapped_column(Integer)
    """Generated tokens a grammar forced (schema 9; NULL on calls recorded before: not recorded)."""
    drafted_tokens: Mapped[int | None] = mapped_column(Integer)
    """Tokens prompt-lookup drafts proposed (schema 9; NULL before)."""
    accepted_tokens: Mapped[int | None] = mapped_column(Integer)
    """Drafted tokens the model confirmed (schema 9; NULL before)."""
    steps_saved: Mapped[int | None] = mapped_column(Integer)
    """Model steps grammar fast-forward saved (schema 9; NULL before); drafts show as fewer model steps."""
