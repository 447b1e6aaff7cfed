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
    """When the row was last written (UTC): the last ``upsert_agent``, which ``Runtime.open_conversation``
    calls for its agent."""


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
    """When the conversation was created or last changed (UTC): a message appended, or messages
    moved into or out of its window (a compaction, a rewind). Taking a lease does not change it."""
    lease_holder: str | None
    """The holder id of the process that runs the conversation (``"box1:4242:9f3a1c"``: host, pid,
    a tag), or None when no lease is held. It may have expired: compare ``lease_expires_at``."""
    lease_expires_at: datetime | None
    """When the current lease lapses (UTC), None when no lease is held; a lapsed lease can be
    taken over."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON the caller attached at creation."""
    parent_id: str | None = None
    """The conversation this one was forked from (None: not a fork)."""
    fork_seq: int | None = None
    """A fork shares its parent's messages 1..fork_seq; its own continue after (None: not a fork)."""


@dataclass(frozen=True)
class ConversationSummary:
    """A line of ``list_conversations``: the conversation and what its history holds."""

    id: str
    """The conversation id."""
    agent_name: str
    """The agent the conversation runs."""
    created_at: datetime
    """When the conversation was created (UTC)."""
    updated_at: datetime
    """When a message was last appended or moved into or out of the window (UTC); the list is
    newest first by it."""
    message_count: int
    """Every message the conversation stores itself, in or out of the window (a fork's shared
    messages are its parent's, not counted here)."""
    total_tokens: int
    """Sum of ``token_count`` over those messages."""
    in_window_tokens: int
    """Sum of ``token_count`` over those of them still in the context window."""
    parent_id: str | None = None
    """The conversation this one was forked from (its messages up to ``fork_seq`` are shared, not
    counted here); None: not a fork."""
    fork_seq: int | None = None
    """The last of the parent's messages the fork shares (None: not a fork)."""


@dataclass(frozen=True)
class StoredMessage:
    """A message as stored: its position in the conversation and its window state."""

    conversation_id: str
    """The conversation the row belongs to (a fork's parent, for a message the fork shares)."""
    seq: int
    """1..n within the conversation, in append order (a fork's own continue after its fork point)."""
    message: Message
    """The chat message as it was appended (content never changes)."""
    token_count: int
    """Tokens of the message's span in the rendered prompt (its role markup included), counted
    when it was appended."""
    in_window: bool
    """False once a policy moved the message out of the context window."""
    replaced_by_seq: int | None
    """The seq of the summary message that replaced this one, if a summary did; None while in the
    window or when it left it otherwise (truncation, a sliding window, a rewind)."""
    created_at: datetime
    """When the message was appended (UTC)."""


@dataclass(frozen=True)
class SnapshotRecord:
    """A KV snapshot's row; the tensors live in the file at ``path``."""

    id: int
    """The row's id, unique in the store."""
    conversation_id: str
    """The conversation whose KV this is."""
    num_tokens: int
    """Tokens of the token log whose KV the snapshot holds: the whole log, keyed blocks and
    file together."""
    token_hash: str
    """``tokens_digest`` of the snapshot's token log."""
    fingerprint: str
    """Model + KV layout identity; restore refuses another fingerprint."""
    precision: str
    """The precision the file stores the KV in: "f32", "bf16", "f16", "u8" or "u8-paged" (a u8
    paged cache's raw blocks); see ``KVSnapshot.precision``."""
    path: Path
    """Absolute path of the snapshot file; with S3 storage ``Path("s3:/bucket/key")``, the object
    (a path keeps one slash)."""
    checksum: str
    """``KVSnapshot.checksum()`` when saved; loading checks the file against it."""
    nbytes: int
    """Bytes of the arrays the file at ``path`` holds (with ``block_keys``: the tail's only)."""
    shifted: bool
    """True when the KV had a span dropped by a RoPE shift (a sliding window): close to, not
    equal to, a fresh prefill of the tokens."""
    created_at: datetime
    """When the row was written (UTC)."""
    block_keys: tuple[str, ...] = ()
    """The keyed blocks holding the KV's full blocks, oldest first (``kv/block_keys.py``); the file
    then holds only the tail after them. Empty: the file holds the whole KV."""
    block_size: int | None = None
    """Tokens per block of ``block_keys`` (None without them)."""
    kv_namespace: str | None = None
    """``KVNamespace.id`` the blocks were keyed in (the first block's parent); None without them."""


@dataclass(frozen=True)
class ResponseRecord:
    """A stored API response: the body as it was returned, and where it sits in its conversation."""

    id: str
    """The response id (``resp_...`` as the server names them), which ``previous_response_id`` names."""
    conversation_id: str
    """The conversation the response answered in."""
    owner: str
    """The namespace that may read it ("" for an open server)."""
    last_seq: int
    """The seq of the conversation's newest message when it was saved: a response continues its
    conversation only while this is still the newest (otherwise it would branch)."""
    body: dict[str, Any]
    """The response object as the server returned it (JSON)."""
    created_at: datetime
    """When it was saved (UTC)."""


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
    """Bytes of the snapshot files (or objects) removed, plus those of the keyed KV blocks no
    snapshot named any more."""


@dataclass(frozen=True)
class CallRecord:
    """One model call of a stored conversation (``Store.record_call`` / ``Store.calls``)."""

    conversation_id: str
    """The conversation the call ran on."""
    prompt_tokens: int
    """Tokens of the call's prompt."""
    reused_tokens: int
    """Prompt tokens held by the conversation's KV (or restored), not computed."""
    prefix_cache_tokens: int
    """Prompt tokens shared from the prefix cache, not computed."""
    prefilled_tokens: int
    """Prompt tokens run through the model before the first new token."""
    generated_tokens: int
    """New tokens the call generated (a stop token that ended it included)."""
    ttft_s: float
    """Seconds from the call to its first new token."""
    tpot_s: float
    """Mean seconds per generated token after the first."""
    kv_tokens: int
    """Tokens in the conversation's KV when the call returned."""
    kv_bytes: int
    """Bytes that KV occupies in the model's cache precision."""
    cache_break: dict[str, Any] | None = None
    """Where and why the call reused less than its conversation held (``CacheBreak.as_json()``:
    its fields, ``discarded`` and the ``summary`` line); None when it reused all of it."""
    compaction: dict[str, Any] | None = None
    """The context compaction just before the call (``policy``, ``tokens_before``, ``tokens_after``,
    ``messages_removed``, ``fallback``); None when there was none."""
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
    """The row's id, counting up in record order (0 on a record not stored yet)."""
    created_at: datetime | None = None
    """When the row was written (UTC); None on a record not stored yet."""
