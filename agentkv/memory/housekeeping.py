"""Store work that spans a transaction and the snapshot directory: save a snapshot and prune.

Each function runs in the store's worker thread, writes rows in one transaction and removes
files only once it has committed (a crash loses nothing kept; files left behind are
unreferenced, and the next prune removes them)::

    record = save_snapshot(db, files, "abc", snap, keep=2, budget_bytes=None, fence=None)
    report = prune(db, files, cutoff=utcnow() - timedelta(days=30), keep_snapshots=1,
                   orphans_older_than=timedelta(minutes=10), now=utcnow())
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from agentkv.errors import UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import queries, retention, snapshot_rows
from agentkv.kvstore.block_store import BlockStore
from agentkv.memory.database import Database
from agentkv.memory.records import PruneReport, SnapshotRecord
from agentkv.memory.snapshots import SnapshotStorage


def save_snapshot(db: Database, files: SnapshotStorage, conversation_id: str, snapshot: KVSnapshot, *, keep: int,
                  budget_bytes: int | None, fence: int | None, blocks: BlockStore | None = None,
                  namespace: KVNamespace | None = None, log: tuple[Sequence[int], Sequence[int]] | None = None,
                  ) -> SnapshotRecord:
    """Write the snapshot file, then its row; prune beyond the ``keep`` newest and past
    ``budget_bytes``. A failed row write removes the file again. With ``blocks`` and ``namespace``
    (and a snapshot that knows its cuts and was not shifted) the full blocks go to the block store
    — only those no tier holds yet — and the file keeps the tail after them. ``log`` (the whole
    log's tokens and cuts): ``snapshot`` is then the span of it from a block bound whose blocks
    before are stored (``BlockStore.first_unknown``), and the row describes the whole log."""
    db.read(lambda s: queries.conversation_row(s, conversation_id))  # no file for a missing conversation
    chain = stored = None
    tokens, start = (snapshot.tokens, 0) if log is None else (tuple(log[0]), len(log[0]) - snapshot.num_tokens)
    if log is not None and (blocks is None or namespace is None or snapshot.cuts is None or start < 0):
        raise UserError("a span of a log is saved as keyed blocks only: pass blocks, a namespace, and the "
                        "span's whole log (tokens and cuts)")
    if blocks is not None and namespace is not None and snapshot.cuts is not None and not snapshot.shifted:
        chain = namespace.chain(tokens, cuts=snapshot.cuts if log is None else log[1])
        blocks.save_durably(snapshot, chain, start=start)
        stored = snapshot.span(chain.tail.start - start, snapshot.num_tokens)
    name = files.write(conversation_id, snapshot if stored is None else stored)

    def add(s: Session) -> tuple[SnapshotRecord, list[str]]:
        record = snapshot_rows.add(s, files, conversation_id, snapshot, name, fence, blocks=chain, stored=stored,
                                   tokens=tokens)
        pruned = retention.excess_snapshots(s, files, keep, conversation_id=conversation_id)
        if budget_bytes is not None:
            s.flush()
            pruned += retention.over_budget(s, budget_bytes, keep_conversation=conversation_id)
        return record, pruned

    try:
        record, pruned = db.write(add)
    except BaseException:
        files.remove([name])
        raise
    files.remove(pruned)
    return record


def prune(db: Database, files: SnapshotStorage, *, cutoff: datetime | None, keep_snapshots: int | None,
          orphans_older_than: timedelta, now: datetime, blocks: BlockStore | None = None) -> PruneReport:
    """Delete conversations not updated since ``cutoff`` (and not leased at ``now``), snapshots beyond
    the newest ``keep_snapshots`` of each conversation (rows in one transaction, then their files), then
    unreferenced files — and, with ``blocks``, keyed blocks no row names — older than
    ``orphans_older_than``."""
    def rows(s: Session) -> tuple[list[str], list[str]]:
        deleted, names = retention.old_conversations(s, cutoff, now) if cutoff is not None else ([], [])
        if keep_snapshots is not None:
            names += retention.excess_snapshots(s, files, keep_snapshots)
        retention.expire_prompt_blocks(s, now)
        return deleted, names

    deleted, names = db.write(rows)
    freed = files.remove(names)
    orphans = files.unreferenced(db.read(retention.referenced_files), older_than=orphans_older_than)
    freed += files.remove(orphans)
    if blocks is not None:
        freed += blocks.collect(db.read(retention.referenced_blocks), older_than=orphans_older_than)
    return PruneReport(tuple(deleted), len(names) + len(orphans), len(orphans), freed)
