"""The SQL of KV snapshot rows: insert one (whole, or keyed blocks plus a tail), list a conversation's, delete one.

Every function takes an open SQLAlchemy ``Session`` (one transaction of ``Store``'s)::

    record = snapshot_rows.add(s, files, "sess-1", snapshot, name, fence=3)
    newest = snapshot_rows.of_conversation(s, files, "conv-1")[0]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from agentkv.kv.block_keys import BlockChain
from agentkv.kv.digest import tokens_digest
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import convert
from agentkv.memory.queries import fenced_row, conversation_row
from agentkv.memory.records import SnapshotRecord
from agentkv.memory.schema import SnapshotRow, utcnow
from agentkv.memory.snapshots import SnapshotStorage


def add(s: Session, files: SnapshotStorage, conversation_id: str, snapshot: KVSnapshot,
        name: str, fence: int | None = None, *, blocks: BlockChain | None = None,
        stored: KVSnapshot | None = None, tokens: Sequence[int] | None = None) -> SnapshotRecord:
    """Insert the row of a written file (retention then decides what else stays): the whole of
    ``snapshot``, or with ``blocks`` the keyed blocks of its KV and ``stored``, the tail in the file;
    ``tokens``: the whole log's, when ``snapshot`` is a span of it."""
    fenced_row(s, conversation_id, fence)
    in_file = snapshot if stored is None else stored
    tokens = snapshot.tokens if tokens is None else tokens
    row = SnapshotRow(conversation_id=conversation_id, num_tokens=len(tokens),
                      token_hash=tokens_digest(tokens), fingerprint=snapshot.fingerprint,
                      precision=snapshot.precision, path=name, checksum=in_file.checksum(),
                      nbytes=in_file.nbytes, shifted=snapshot.shifted, created_at=utcnow())
    if blocks is not None:
        row.block_keys = " ".join(blocks.keys)
        row.block_size = blocks.namespace.block_size
        row.kv_namespace = blocks.namespace.id
    s.add(row)
    s.flush()
    return convert.snapshot_record(row, files)


def of_conversation(s: Session, files: SnapshotStorage, conversation_id: str) -> list[SnapshotRecord]:
    conversation_row(s, conversation_id)
    return [convert.snapshot_record(row, files) for row in s.scalars(newest_first(conversation_id))]


def delete(s: Session, snapshot_id: int) -> str | None:
    """Delete a snapshot row; return its file name (None if the row was already gone)."""
    row = s.get(SnapshotRow, snapshot_id)
    if row is None:
        return None
    s.delete(row)
    return row.path


def newest_first(conversation_id: str) -> Any:
    return (select(SnapshotRow).where(SnapshotRow.conversation_id == conversation_id)
            .order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc()))
