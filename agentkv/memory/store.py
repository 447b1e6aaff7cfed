"""The persistent store: agents, conversations, append-only messages, leases and KV snapshots.

An async API over a synchronous SQLAlchemy engine (each call runs one transaction in a
worker thread); SQLite by default, any SQLAlchemy URL such as PostgreSQL for many processes::

    store = Store.from_env()                      # AGENTKV_DB_URL or the default SQLite file
    await store.upsert_agent("helper", "Be brief.", ["calc"], {})
    conversation = await store.create_conversation("helper")
    await store.append_message(session.id, Message.user("hi"), token_count=3)
    await store.close()

A write has been committed when its coroutine returns. Cancelling the coroutine does not
abort a transaction already running: the thread finishes it, then the cancellation lands.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import anyio.to_thread
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from agentkv.chat.messages import Message
from agentkv.errors import ConversationExists, UserError
from agentkv.kv.block_keys import BLOCK_MULTIPLE, KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import convert, housekeeping, queries, snapshot_rows
from agentkv.memory.block_snapshots import SNAPSHOT_FILE, load_block_snapshot
from agentkv.kvstore.block_store import BlockStore
from agentkv.memory.database import Database, default_snapshot_dir
from agentkv.memory.export import conversation_jsonl
from agentkv.memory.kv_tiers import DEFAULT_HOST_BYTES, block_tiers
from agentkv.memory.leases import WRITE_LEASE_WAIT_S, fence_or_lease
from agentkv.memory.records import (
    AgentRecord,
    CallRecord,
    PruneReport,
    ResponseRecord,
    ConversationRecord,
    ConversationSummary,
    SnapshotRecord,
    StoredMessage,
)
from agentkv.memory.schema import Clock, utcnow
from agentkv.memory.conversation_leases import ConversationLeases
from agentkv.memory.snapshots import (
    ENV_SNAPSHOT_URL,
    SnapshotStorage,
    open_snapshot_storage,
    refuse_other_fingerprint,
)


ENV_DB_URL = "AGENTKV_DB_URL"
"""Environment variable read by ``Store.from_env`` (only there)."""
SNAPSHOTS_KEPT = 2
"""Snapshots kept per conversation by default; older ones are pruned on save."""
DEFAULT_BLOCK_TOKENS = 32
"""Tokens per stored KV block by default (one paged block; see the KV store's benchmark)."""
BLOCK_FLUSH_WAIT_S = 30.0
"""How long ``Store.close`` waits for queued KV blocks to be written."""
ORPHAN_GRACE = timedelta(minutes=10)
"""An unreferenced snapshot file younger than this may be a save in progress: prune leaves it."""


class Store(ConversationLeases):
    """Agents, conversations, messages and KV snapshots in one database plus a snapshot storage.

    ``Store("sqlite:////tmp/a.db")``, ``Store("postgresql+psycopg2://u:p@host/db",
    snapshot_dir=Path("/srv/kv"))``, ``Store(pg_url, snapshots="s3://bucket/kv")``. The schema is
    created or upgraded on first use; a database from a newer agentkv raises ``SchemaVersionError`` then.

    ``rewind``, ``fork_conversation`` (its parent) and ``delete_conversation`` change a conversation's history under
    its lease: a caller holding it passes its token (``fence=``; ``LeaseLost`` once it passed on); else
    they take it for their one transaction, waiting ``lease_wait_s`` for a live run, then ``ConversationBusy``.
    """

    def __init__(self, url: str | None = None, *, snapshot_dir: Path | None = None,
                 snapshots: str | Path | None = None,
                 keep_snapshots: int = SNAPSHOTS_KEPT, snapshot_budget_bytes: int | None = None,
                 clock: Clock = utcnow, lease_wait_s: float = WRITE_LEASE_WAIT_S,
                 kv_host_bytes: int | None = DEFAULT_HOST_BYTES, kv_disk: Path | None = None,
                 kv_disk_bytes: int | None = None, block_size: int = DEFAULT_BLOCK_TOKENS) -> None:
        """``snapshots``: where KV snapshots go — ``s3://bucket/prefix`` (S3 or an S3-compatible
        server; credentials and endpoint from the standard ``AWS_*`` variables), ``file:///dir`` or a
        directory; default: ``snapshot_dir``, else a directory beside the database (``SnapshotURLError``
        for another scheme). ``keep_snapshots``: the newest snapshots kept per conversation; ``snapshot_budget_bytes``:
        the most all snapshots may take — saving past it deletes the snapshots of the conversations
        used longest ago (they re-prefill when resumed). ``clock``: what leases read the time
        from (``Store(url, clock=FakeClock())`` in a test lets a lease expire without waiting).
        ``lease_wait_s``: see the class docstring. ``kv_host_bytes``, ``kv_disk``, ``kv_disk_bytes``:
        the KV block tiers in front of the snapshot location (``memory/kv_tiers.py``; a snapshot
        directory's blocks are bounded by ``kv_disk_bytes``, else by ``snapshot_budget_bytes``);
        ``block_size``: tokens per stored block (a multiple of 32)."""
        if lease_wait_s < 0:
            raise UserError(f"lease_wait_s must be >= 0 seconds, got {lease_wait_s}")
        if keep_snapshots < 1:
            raise UserError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        if snapshot_budget_bytes is not None and snapshot_budget_bytes < 0:
            raise UserError(f"snapshot_budget_bytes must be >= 0 or None, got {snapshot_budget_bytes}")
        self.keep_snapshots = keep_snapshots
        self.snapshot_budget_bytes = snapshot_budget_bytes
        self.clock = clock
        """The time leases are taken, renewed and checked at (``utcnow`` by default)."""
        self.lease_wait_s = lease_wait_s
        """How long ``rewind``, ``fork_conversation`` and ``delete_conversation`` wait for a run's lease."""
        self.database = Database(url)
        """The database and its transactions: ``store.database.write(lambda s: ...)`` in a thread."""
        self.url = self.database.url
        """The database URL for display (password hidden)."""
        if snapshots is not None and snapshot_dir is not None:
            raise UserError("pass snapshots= (a URL or directory) or snapshot_dir=, not both")
        self.files: SnapshotStorage = open_snapshot_storage(
            snapshots, default_dir=snapshot_dir or default_snapshot_dir(self.database.parsed_url))
        """Where snapshot bytes live: ``SnapshotFiles`` (a directory) or ``SnapshotObjects`` (S3)."""
        if block_size <= 0 or block_size % BLOCK_MULTIPLE:
            raise UserError(f"block_size must be a positive multiple of {BLOCK_MULTIPLE} tokens, got {block_size}")
        self.block_size = block_size
        """Tokens per KV block the store keeps (the ``block_size`` of the namespaces it is given)."""
        self.blocks = BlockStore(block_tiers(self.files, host_bytes=kv_host_bytes, disk=kv_disk,
                                             disk_bytes=kv_disk_bytes if kv_disk_bytes is not None
                                             else snapshot_budget_bytes))
        """The keyed KV blocks snapshots are saved as (their tiers, the write-behind queue)."""

    @classmethod
    def from_env(cls) -> Store:
        """The store at ``$AGENTKV_DB_URL`` (else the default SQLite file), its snapshots at
        ``$AGENTKV_SNAPSHOT_URL`` (else the directory beside the database)."""
        return cls(os.environ.get(ENV_DB_URL) or None, snapshots=os.environ.get(ENV_SNAPSHOT_URL) or None)

    async def close(self) -> None:
        """Write the KV blocks still queued (bounded wait) and close pooled connections; the store
        can still be used afterwards (it reconnects)."""
        await anyio.to_thread.run_sync(self.blocks.flush, BLOCK_FLUSH_WAIT_S)
        await self.database.dispose()

    async def __aenter__(self) -> Store:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- agents and conversations ----------------------------------------------------------------

    async def upsert_agent(self, name: str, instructions: str | None, tool_names: Sequence[str],
                           settings: dict[str, Any]) -> None:
        """Store an agent's definition, replacing a previous one with the same name
        (``instructions=None``: the agent renders no system turn)."""
        args = (name, instructions, [str(t) for t in tool_names],
                convert.json_object(settings, "agent settings"))

        def upsert() -> None:
            try:
                self.database.write(lambda s: queries.upsert_agent(s, *args))
            except IntegrityError:  # another process inserted the same name first: update it
                self.database.write(lambda s: queries.upsert_agent(s, *args))
        await self.database.run(upsert)

    async def get_agent(self, name: str) -> AgentRecord:
        """The stored agent; ``AgentNotFound`` if none has this name."""
        return await self.database.run(self.database.read, lambda s: queries.get_agent(s, name))

    async def create_conversation(self, agent_name: str, *, conversation_id: str | None = None,
                                  metadata: dict[str, Any] | None = None) -> ConversationRecord:
        """A new conversation of a stored agent; ``UserError`` if ``conversation_id`` is taken."""
        sid = conversation_id or uuid.uuid4().hex
        meta = convert.json_object(metadata, "conversation metadata")

        def create() -> ConversationRecord:
            try:
                return self.database.write(lambda s: queries.create_conversation(s, agent_name, sid, meta))
            except IntegrityError as e:
                raise ConversationExists(sid) from e
        return await self.database.run(create)

    async def fork_conversation(self, conversation_id: str, *, at: int | None = None, new_id: str | None = None,
                                metadata: dict[str, Any] | None = None, fence: int | None = None) -> ConversationRecord:
        """A new conversation sharing this one's messages 1..``at`` (default: all) without copying
        them; both go on independently: ``fork = await store.fork_conversation(sid, at=4)``. A fork of
        a fork works; the parent cannot be deleted while forks share its messages. The parent is
        read under its lease (``fence``: see the class docstring): a fork never takes half a turn."""
        sid = new_id or uuid.uuid4().hex
        meta = convert.json_object(metadata, "conversation metadata")
        async with fence_or_lease(self, conversation_id, fence, action="fork") as token:
            return await self.database.run(
                self.database.write, lambda s: queries.fork_conversation(s, conversation_id, sid, at, meta, token))

    async def get_conversation(self, conversation_id: str) -> ConversationRecord:
        """The conversation's row; ``ConversationNotFound`` if absent."""
        return await self.database.run(
            self.database.read, lambda s: convert.conversation_record(queries.conversation_row(s, conversation_id)))

    async def list_conversations(self) -> list[ConversationSummary]:
        """Every conversation with its message and token counts, most recently updated first."""
        return await self.database.run(self.database.read, queries.list_conversations)

    async def delete_conversation(self, conversation_id: str, *, fence: int | None = None) -> None:
        """Delete the conversation, its messages, snapshot rows and snapshot files (``UserError``
        while forks share its messages: delete them first). Under its lease (``fence``: see the class)."""
        def delete(token: int) -> None:
            names = self.database.write(lambda s: queries.delete_conversation(s, conversation_id, token))
            self.files.remove(names)
        async with fence_or_lease(self, conversation_id, fence, action="delete") as token:
            await self.database.run(delete, token)

    # -- messages ---------------------------------------------------------------------------

    async def append_message(self, conversation_id: str, message: Message, *, token_count: int,
                             in_window: bool = True, fence: int | None = None) -> StoredMessage:
        """Append ``message`` as the conversation's next seq; committed when this returns. ``fence``:
        the writer's lease token (``acquire_lease``): ``LeaseLost``, and nothing written, once
        the lease has passed to another holder since."""
        if token_count < 0:
            raise UserError(f"token_count must be >= 0, got {token_count}")
        return await self.database.run(self.database.write, lambda s: queries.append_message(
            s, conversation_id, message, token_count, in_window, fence))

    async def messages(self, conversation_id: str, *, in_window_only: bool = False
                       ) -> list[StoredMessage]:
        """The conversation's messages in seq order (only those in the window if asked)."""
        return await self.database.run(
            self.database.read, lambda s: queries.messages(s, conversation_id, in_window_only))

    async def mark_out_of_window(self, conversation_id: str, seqs: Sequence[int], *,
                                 replaced_by_seq: int | None = None, fence: int | None = None) -> None:
        """Flag messages as out of the context window (they stay stored), optionally
        recording the summary message that replaced them. ``UserError`` for unknown seqs;
        ``fence`` as for ``append_message``."""
        chosen = [int(seq) for seq in seqs]
        if not chosen:
            return
        await self.database.run(self.database.write, lambda s: queries.mark_out_of_window(
            s, conversation_id, chosen, replaced_by_seq, fence))

    async def replace_in_window(self, conversation_id: str, seqs: Sequence[int], replacement: Message,
                                *, token_count: int, fence: int | None = None) -> StoredMessage:
        """Append ``replacement`` (a summary, a message cut to fit) and mark ``seqs`` out of the
        window, replaced by it — one transaction: a crash leaves both or neither. ``fence`` as
        for ``append_message``."""
        chosen = [int(seq) for seq in seqs]
        if token_count < 0:
            raise UserError(f"token_count must be >= 0, got {token_count}")

        def replace(s: Any) -> StoredMessage:
            stored = queries.append_message(s, conversation_id, replacement, token_count, True, fence)
            if chosen:
                queries.mark_out_of_window(s, conversation_id, chosen, stored.seq)
            return stored

        return await self.database.run(self.database.write, replace)

    async def last_seq(self, conversation_id: str) -> int:
        """The seq of the conversation's newest message (0 for none); ``ConversationNotFound`` if absent."""
        def read(s: Session) -> int:
            queries.conversation_row(s, conversation_id)
            return queries.last_seq(s, conversation_id)
        return await self.database.run(self.database.read, read)

    async def rewind(self, conversation_id: str, after_seq: int, *, keep_responses: bool = False,
                     fence: int | None = None) -> int:
        """Take every message after ``after_seq`` out of the window (they stay stored) and put
        back the ones a later summary had replaced, in one transaction; returns how many left:
        ``await store.rewind(sid, 4)`` (e.g. the input of a run that never finished). Messages a
        later truncation dropped stay out (the window would overflow again without them).
        ``keep_responses=True`` refuses (``ResponseSuperseded``, nothing changed) when a stored
        response covers a message after ``after_seq``: someone continued the conversation first.
        Under the conversation's lease (``fence``: see the class docstring)."""
        async with fence_or_lease(self, conversation_id, fence, action="rewind") as token:
            return await self.database.run(self.database.write, lambda s: queries.rewind(
                s, conversation_id, int(after_seq), keep_responses, token))

    async def export_jsonl(self, conversation_id: str, *, in_window_only: bool = False) -> str:
        """The conversation as OpenAI chat messages, one JSON object per line: its agent's system
        prompt, then every message (only the window's with ``in_window_only``), those out of
        the window marked (``agentkv.memory.export``): ``print(await store.export_jsonl(sid))``."""
        agent = await self.get_agent((await self.get_conversation(conversation_id)).agent_name)
        stored = await self.messages(conversation_id, in_window_only=in_window_only)
        return conversation_jsonl(agent.instructions, stored)

    # -- KV snapshots -----------------------------------------------------------------------

    async def save_snapshot(self, conversation_id: str, snapshot: KVSnapshot, *,
                            keep: int | None = None, fence: int | None = None, tenant: str = "",
                            namespace: KVNamespace | None = None,
                            log: tuple[Sequence[int], Sequence[int]] | None = None) -> SnapshotRecord:
        """Write the snapshot (a file: temp + rename; an object: one PUT), then its row; prune beyond
        ``keep`` newest (default: the store's ``keep_snapshots``) and past the store's byte
        budget. ``fence`` as for ``append_message``; ``tenant``: the conversation's tenant salt
        (S3 keys are per tenant). With ``namespace`` (``engine.kv_namespace(salt=...,
        block_size=store.block_size)``) the KV's full blocks go to the block store — each written
        once, whoever shares it — and the file keeps the tail; ``log`` (the whole log's tokens and
        cuts) when ``snapshot`` is only its span from the first block no tier holds."""
        keep = self.keep_snapshots if keep is None else keep
        if keep < 1:
            raise UserError(f"keep must be >= 1, got {keep}")
        if namespace is not None and namespace.block_size != self.block_size:
            raise UserError(f"the namespace keys {namespace.block_size}-token blocks but this store keeps "
                            f"{self.block_size}: pass engine.kv_namespace(..., block_size=store.block_size)")
        files = self.files.scoped(tenant)
        return await self.database.run(partial(housekeeping.save_snapshot, self.database, files, conversation_id,
                                               snapshot, keep=keep, budget_bytes=self.snapshot_budget_bytes,
                                               fence=fence, blocks=self.blocks, namespace=namespace, log=log))

    async def prune(self, *, older_than: timedelta | None = None, keep_snapshots: int | None = None,
                    orphans_older_than: timedelta = ORPHAN_GRACE) -> PruneReport:
        """Delete conversations not updated for ``older_than`` (not leased, nor leased meanwhile; a
        parent whose forks stay is kept), snapshots beyond the newest ``keep_snapshots`` of each conversation, and
        snapshot files no row points to that are older than ``orphans_older_than`` (a save writes its
        file just before its row). Rows go in one transaction, files after it commits: a crash
        loses nothing kept. ``await store.prune(older_than=timedelta(days=30), keep_snapshots=1)``"""
        if keep_snapshots is not None and keep_snapshots < 1:
            raise UserError(f"keep_snapshots must be >= 1, got {keep_snapshots}")
        cutoff = utcnow() - older_than if older_than is not None else None
        return await self.database.run(partial(housekeeping.prune, self.database, self.files, cutoff=cutoff,
                                               keep_snapshots=keep_snapshots, orphans_older_than=orphans_older_than,
                                               now=self.clock(), blocks=self.blocks))

    async def snapshots(self, conversation_id: str) -> list[SnapshotRecord]:
        """The conversation's snapshot records, newest first."""
        return await self.database.run(self.database.read,
                                       lambda s: snapshot_rows.of_conversation(s, self.files, conversation_id))

    async def load_snapshot(self, record: SnapshotRecord, *, expected_fingerprint: str,
                            namespace: KVNamespace | None = None,
                            sources: dict[str, int] | None = None) -> KVSnapshot:
        """Read and verify a snapshot (file or object; keyed blocks too, given the ``namespace``
        they were saved in): the whole KV, or of a block snapshot the part the tiers still hold
        (a prefix of it; the caller re-prefills the rest).

        ``SnapshotIncompatible`` for another fingerprint or namespace; ``SnapshotCorrupt`` for a
        missing, damaged or replaced one (``delete_snapshot`` it; the conversation re-prefills);
        ``SnapshotStoreUnavailable`` when the S3 endpoint cannot be used. ``sources``, when given,
        gets the tokens of KV each place gave: ``{"host": 64, "s3": 256, "snapshot": 20}``.
        """
        refuse_other_fingerprint(record.path, record.fingerprint, expected_fingerprint)
        load = partial(self.files.load, str(record.path),
                       expected_fingerprint=expected_fingerprint,
                       expected_checksum=record.checksum)
        if not record.block_keys:
            whole = await anyio.to_thread.run_sync(load)
            if sources is not None:
                sources[SNAPSHOT_FILE] = whole.num_tokens
            return whole
        return await anyio.to_thread.run_sync(partial(load_block_snapshot, self.blocks, record, load, namespace,
                                                      sources))

    async def delete_snapshot(self, record: SnapshotRecord) -> None:
        """Delete one snapshot's row and file (e.g. after ``SnapshotCorrupt``)."""
        def delete() -> None:
            name = self.database.write(lambda s: snapshot_rows.delete(s, record.id))
            self.files.remove([name or str(record.path)])
        await self.database.run(delete)

    # -- model calls ------------------------------------------------------------------------

    async def record_call(self, record: CallRecord, *, fence: int | None = None) -> CallRecord:
        """Keep one model call's figures (``ConversationNotFound`` for an unknown conversation; ``fence``: as
        appends)."""
        return await self.database.run(self.database.write, lambda s: queries.add_call(s, record, fence))

    async def calls(self, conversation_id: str) -> list[CallRecord]:
        """The conversation's model calls, oldest first."""
        return await self.database.run(self.database.read, lambda s: queries.calls(s, conversation_id))

    # -- API responses ----------------------------------------------------------------------

    async def save_response(self, response_id: str, conversation_id: str, body: dict[str, Any], *,
                            owner: str = "", fence: int | None = None) -> ResponseRecord:
        """Keep an API response of ``conversation_id`` (covering its messages so far), readable by
        ``owner`` only: ``await store.save_response("resp_1", sid, body, owner="tenant-a")``;
        ``fence``: the run's lease token (``LeaseLost`` once another holder took the lease)."""
        payload = convert.json_object(body, "response body")
        return await self.database.run(self.database.write, lambda s: queries.add_response(
            s, response_id, conversation_id, owner, payload, fence))

    async def get_response(self, response_id: str, *, owner: str = "") -> ResponseRecord:
        """The stored response; ``ResponseNotFound`` if absent or another owner's."""
        return await self.database.run(self.database.read, lambda s: convert.response_record(
            queries.response_row(s, response_id, owner)))

    async def responses(self, conversation_id: str) -> list[ResponseRecord]:
        """The conversation's stored responses, newest first (every owner's)."""
        return await self.database.run(self.database.read, lambda s: queries.responses_of(s, conversation_id))

    async def delete_response(self, response_id: str, *, owner: str = "") -> bool:
        """Delete a response (``ResponseNotFound`` if absent or another owner's; ``ConversationBusy``
        while a run, here or in another process, holds its conversation). The conversation goes with its
        last response — messages, snapshots and files; returns True then."""
        def delete() -> bool:
            gone, names = self.database.write(lambda s: queries.delete_response(s, response_id, owner, self.clock()))
            self.files.remove(names)
            return gone
        return await self.database.run(delete)
