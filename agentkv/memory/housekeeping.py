"""Store work that spans a transaction and the snapshot directory: save a snapshot and prune.

Each function runs in the store's worker thread, writes rows in one transaction and removes
files only once it has committed (a crash loses nothing kept; files left behind are
unreferenced, and the next prune removes them)::

    record = save_snapshot(db, files, "abc", snap, keep=2, budget_bytes=None, fence=None)
    report = prune(db, files, cutoff=utcnow() - timedelta(days=30), keep_snapshots=1,
                   orphans_older_than=timedelta(minutes=10), now=utcnow())
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy.orm import Session

from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import queries, retention
from agentkv.memory.database import Database
from agentkv.memory.records import PruneReport, SnapshotRecord
from agentkv.memory.snapshots import SnapshotStorage


def save_snapshot(db: Database, files: SnapshotStorage, session_id: str, snapshot: KVSnapshot, *, keep: int,
                  budget_bytes: int | None, fence: int | None) -> SnapshotRecord:
    """Write the snapshot file, then its row; prune beyond the ``keep`` newest and past
    ``budget_bytes``. A failed row write removes the file again."""
    db.read(lambda s: queries.session_row(s, session_id))  # no file for a missing session
    name = files.write(session_id, snapshot)

    def add(s: Session) -> tuple[SnapshotRecord, list[str]]:
        record = queries.add_snapshot(s, files, session_id, snapshot, name, fence)
        pruned = retention.excess_snapshots(s, files, keep, session_id=session_id)
        if budget_bytes is not None:
            s.flush()
            pruned += retention.over_budget(s, budget_bytes, keep_session=session_id)
        return record, pruned

    try:
        record, pruned = db.write(add)
    except BaseException:
        files.remove([name])
        raise
    files.remove(pruned)
    return record


def prune(db: Database, files: SnapshotStorage, *, cutoff: datetime | None, keep_snapshots: int | None,
          orphans_older_than: timedelta, now: datetime) -> PruneReport:
    """Delete sessions not updated since ``cutoff`` (and not leased at ``now``), snapshots beyond
    the newest ``keep_snapshots`` of each session (rows in one transaction, then their files), then
    unreferenced files older than ``orphans_older_than``."""
    def rows(s: Session) -> tuple[list[str], list[str]]:
        deleted, names = retention.old_sessions(s, cutoff, now) if cutoff is not None else ([], [])
        if keep_snapshots is not None:
            names += retention.excess_snapshots(s, files, keep_snapshots)
        return deleted, names

    deleted, names = db.write(rows)
    freed = files.remove(names)
    orphans = files.unreferenced(db.read(retention.referenced_files), older_than=orphans_older_than)
    freed += files.remove(orphans)
    return PruneReport(tuple(deleted), len(names) + len(orphans), len(orphans), freed)
