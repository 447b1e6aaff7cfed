"""What the store hands back: frozen records, never ORM rows.

``record = await store.get_conversation(sid); print(record.agent_name, record.lease_holder)``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from agentkv.chat.messages import Message


@dataclass(frozen=True)
class AgentRecord:
    """An agent's stored definition (what ``upsert_agent`` wrote last)."""

    name: str
    """Primary key: the agent's name."""
    instructions: str | None
    """The system prompt the agent runs with (None: no system turn, the template's default)."""
    tool_names: tuple[str, ...]
    """Names of the tools the agent may call."""
    settings: dict[str, Any]
    """Generation and policy settings as plain JSON."""
    updated_at: datetime
    """When the row was last written (UTC)."""


@dataclass(frozen=True)
class ConversationRecord:
    """One conversation's row."""

    id: str
    """The conversation id (given to ``create_conversation`` or a fresh uuid hex)."""
    agent_name: str
    """The agent the conversation runs."""
    created_at: datetime
    """When the conversation was created (UTC)."""
    updated_at: datetime
    """When a message was last appended or marked (UTC)."""
    lease_holder: str | None
    """Who runs the conversation now (may be expired: compare ``lease_expires_at``)."""
    lease_expires_at: datetime | None
    """When the current lease lapses (UTC); a lapsed lease can be taken over."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON the caller attached at creation."""
    parent_id: str | None = None
    """The conversation this one was forked from (None: not a fork)."""
    fork_seq: int | None = None
    """A fork shares its parent's messages 1..fork_seq; its own continue after."""


@dataclass(frozen=True)
class ConversationSummary:
    """A line of ``list_conversations``: the conversation and what its history holds."""

    id: str
    agent_name: str
    created_at: datetime
    updated_at: datetime
    message_count: int
    """Every stored message, in or out of the window."""
    total_tokens: int
    """Sum of ``token_count`` over every stored message."""
    in_window_tokens: int
    """Sum of ``token_count`` over the messages still in the context window."""
    parent_id: str | None = None
    """The conversation this one was forked from (its messages up to ``fork_seq`` are shared, not counted here)."""
    fork_seq: int | None = None


@dataclass(frozen=True)
class StoredMessage:
    """A message as stored: its position in the conversation and its window state."""

    conversation_id: str
    """The conversation the row belongs to (a fork's parent, for a message the fork shares)."""
    seq: int
    """1..n within the conversation, in append order (a fork's own continue after its fork point)."""
    message: Message
    token_count: int
    """Tokens the message took when rendered into the prompt."""
    in_window: bool
    """False once a policy moved the message out of the context window."""
    replaced_by_seq: int | None
    """The summary message that replaced this one, if a summary did."""
    created_at: datetime


@dataclass(frozen=True)
class SnapshotRecord:
    """A KV snapshot's row; the tensors live in the file at ``path``."""

    id: int
    conversation_id: str
    num_tokens: int
    token_hash: str
    """``tokens_digest`` of the snapshot's token log."""
    fingerprint: str
    """Model + KV layout identity; restore refuses another fingerprint."""
    precision: str
    path: Path
    """Absolute path of the snapshot file."""
    checksum: str
    """``KVSnapshot.checksum()`` when saved; loading checks the file against it."""
    nbytes: int
    """Bytes of the arrays the file at ``path`` holds (with ``block_keys``: the tail's only)."""
    shifted: bool
    created_at: datetime
    block_keys: tuple[str, ...] = ()
    """The keyed blocks holding the KV's full blocks, oldest first (``kv/block_keys.py``); the file
    then holds only the tail after them. Empty: the file holds the whole KV."""
    block_size: int | None = None
    """Tokens per block of ``block_keys``."""
    kv_namespace: str | None = None
    """``KVNamespace.id`` the blocks were keyed in (the first block's parent)."""


@dataclass(frozen=True)
class ResponseRecord:
    """A stored API response: the body as it was returned, and where it sits in its session."""

    id: str
    conversation_id: str
    owner: str
    """The namespace that may read it ("" for an open server)."""
    last_seq: int
    """The seq of the conversation's newest message when it was saved: a response continues its
    conversation only while this is still the newest (otherwise it would branch)."""
    body: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True)
class PruneReport:
    """What ``Store.prune`` deleted."""

    conversations: tuple[str, ...]
    """Ids of the conversations deleted (rows, messages, responses, snapshots)."""
    snapshots: int
    """Snapshot files removed: of deleted conversations, beyond the kept newest, and orphans."""
    orphan_files: int
    """Files in the snapshot directory no row pointed to (left by a crash), removed."""
    bytes_freed: int


@dataclass(frozen=True)
class CallRecord:
    """One model call of a stored conversation (``Store.record_call`` / ``Store.calls``)."""

    conversation_id: str
    prompt_tokens: int
    reused_tokens: int
    """Held by the conversation's KV (or restored), not computed."""
    prefix_cache_tokens: int
    """Shared from the prefix cache, not computed."""
    prefilled_tokens: int
    generated_tokens: int
    ttft_s: float
    tpot_s: float
    kv_tokens: int
    kv_bytes: int
    cache_break: dict[str, Any] | None = None
    """Where and why the call reused less than its conversation held (``CacheBreak`` as JSON)."""
    compaction: dict[str, Any] | None = None
    """The context compaction just before the call (policy, tokens before and after)."""
    forced_tokens: int | None = None
    """Generated tokens a grammar forced, taken without sampling (None: a call recorded before
    schema 9, which did not keep these four figures)."""
    drafted_tokens: int | None = None
    """Tokens prompt-lookup drafts proposed."""
    accepted_tokens: int | None = None
    """Drafted tokens the model's own choice confirmed."""
    steps_saved: int | None = None
    """Model steps grammar fast-forward saved against one step per token (what drafts save
    shows as fewer model steps)."""
    id: int = 0
    created_at: datetime | None = None
