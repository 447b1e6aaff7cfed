"""Retention in SQL: what pruning and the snapshot byte budget delete. Each function runs inside
the caller's transaction and returns the snapshot file names to remove once it commits (so a crash
before then deletes nothing, and one after leaves only unreferenced files, which the next prune
removes).

::

    names = over_budget(s, budget_bytes=4 << 30, keep_conversation="abc")
    deleted, names = old_conversations(s, cutoff, now=utcnow())

Which snapshots of a conversation stay: whole files before known-damaged ones (missing, or cut
shorter than their arrays), newest first within each — a damaged newest snapshot never pushes
out the good older one that a resume would fall back on.
"""

from __future__ import annotations

from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from agentkv.memory import branches, queries
from agentkv.memory.schema import AnswerTokensRow, PromptBlockRow, ConversationRow, SnapshotRow
from agentkv.memory.snapshots import SnapshotStorage


def over_budget(s: Session, budget_bytes: int, keep_conversation: str) -> list[str]:
    """Delete the snapshots of the conversations used longest ago (by their newest snapshot) until the
    snapshots' bytes fit ``budget_bytes``; ``keep_conversation``'s are never chosen."""
    total = int(s.execute(select(func.coalesce(func.sum(SnapshotRow.nbytes), 0))).scalar() or 0)
    if total <= budget_bytes:
        return []
    newest = func.max(SnapshotRow.created_at)
    by_age = s.execute(select(SnapshotRow.conversation_id, func.sum(SnapshotRow.nbytes))
                       .where(SnapshotRow.conversation_id != keep_conversation)
                       .group_by(SnapshotRow.conversation_id).order_by(newest, SnapshotRow.conversation_id)).all()
    names: list[str] = []
    for conversation_id, nbytes in by_age:
        if total <= budget_bytes:
            break
        names += _drop_snapshots(s, conversation_id, keep=0)
        total -= int(nbytes)
    return names


def excess_snapshots(s: Session, files: SnapshotStorage, keep: int, *, conversation_id: str | None = None) -> list[str]:
    """Delete each conversation's snapshots (only ``conversation_id``'s, if given) beyond the ``keep`` it
    keeps (see the module docstring for which)."""
    chosen = ([conversation_id] if conversation_id is not None
              else list(s.scalars(select(SnapshotRow.conversation_id).distinct())))
    names: list[str] = []
    for each in chosen:
        names += _drop_snapshots(s, each, keep=keep, files=files)
    return names


def old_conversations(s: Session, cutoff: datetime, now: datetime) -> tuple[list[str], list[str]]:
    """Delete the conversations not updated since ``cutoff`` and not leased at ``now``, a fork before its
    parent (a parent whose forks stay is kept); returns the ids deleted and their snapshot file names.
    Each is checked again on its locked row: a run that took its lease (or wrote) since keeps it."""
    candidates = set(s.scalars(select(ConversationRow.id).where(ConversationRow.updated_at < cutoff)))
    deleted: list[str] = []
    names: list[str] = []
    progress = True
    while progress:
        progress = False
        for conversation_id in sorted(candidates):
            if branches.forks_of(s, conversation_id):
                continue
            candidates.discard(conversation_id)
            progress = True
            if _still_old_and_free(s, conversation_id, cutoff, now):
                names += queries.delete_conversation(s, conversation_id)
                s.flush()
                deleted.append(conversation_id)
    return deleted, names


def _still_old_and_free(s: Session, conversation_id: str, cutoff: datetime, now: datetime) -> bool:
    """Whether the conversation, its row now locked, is still not updated since ``cutoff`` and not leased."""
    # NOTE: on PostgreSQL the candidates were read without a lock: a run may have taken the lease
    # since. The row lock makes one that takes it now wait for this transaction (and then find
    # the conversation gone); reading the columns again shows one that took it before.
    queries.conversation_row(s, conversation_id, for_update=True)
    updated, expires = s.execute(select(ConversationRow.updated_at, ConversationRow.lease_expires_at)
                                 .where(ConversationRow.id == conversation_id)).one()
    return bool(updated < cutoff) and (expires is None or expires < now)


def referenced_files(s: Session) -> set[str]:
    """The file names snapshot rows point to."""
    return set(s.scalars(select(SnapshotRow.path)))


def referenced_blocks(s: Session) -> set[str]:
    """The keyed blocks snapshot rows and the prompt index name (what the block collector keeps)."""
    named = {key for keys in s.scalars(select(SnapshotRow.block_keys).where(SnapshotRow.block_keys.is_not(None)))
             for key in (keys or "").split()}
    return named | set(s.scalars(select(PromptBlockRow.block_key)))


PROMPT_BLOCKS_KEPT = timedelta(days=7)
"""How long a conversation sent whole keeps its KV findable after its last turn (``memory/prompt_kv.py``)."""


def expire_prompt_blocks(s: Session, now: datetime, kept: timedelta = PROMPT_BLOCKS_KEPT) -> int:
    """Delete prompt-index rows no save named for ``kept``; returns how many (their blocks are then
    collected unless something else names them)."""
    result = s.execute(delete(PromptBlockRow).where(PromptBlockRow.used_at < now - kept))
    s.execute(delete(AnswerTokensRow).where(AnswerTokensRow.used_at < now - kept))
    return int(getattr(result, "rowcount", 0) or 0)


def _drop_snapshots(s: Session, conversation_id: str, *, keep: int, files: SnapshotStorage | None = None) -> list[str]:
    newest_first = list(s.scalars(select(SnapshotRow).where(SnapshotRow.conversation_id == conversation_id)
                                  .order_by(SnapshotRow.created_at.desc(), SnapshotRow.id.desc())))
    if files is not None and len(newest_first) > keep:  # NOTE: a stable sort keeps newest first in each group
        newest_first.sort(key=lambda row: not files.looks_whole(row.path, row.nbytes))
    rows = newest_first[keep:]
    if rows:
        s.execute(delete(SnapshotRow).where(SnapshotRow.id.in_([row.id for row in rows])))
    return [row.path for row in rows]
