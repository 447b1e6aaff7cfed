"""Branches in SQL: a fork shares its parent's messages up to ``fork_seq`` without copying a row,
and each session sees the window of what it shares as it was at its fork point, plus its own marks.

A session's view is its own rows and, up its lineage, each ancestor's rows up to the seq the branch
below shares. An ancestor's window flags are read *as of* that seq (a message it moved out of the
window later is still in the fork's window); the fork's own window changes to shared messages are
``branch_marks``, never an update of the parent's rows::

    rows = view(s, session_id)          # [(MessageRow, in_window, replaced_by_seq)] in seq order
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from agentkv.errors import SessionExists, UserError
from agentkv.memory.schema import BranchMarkRow, MessageRow, SessionRow, utcnow


@dataclass(frozen=True)
class Seen:
    """A message as one session sees it."""

    row: MessageRow
    in_window: bool
    replaced_by_seq: int | None


def lineage(s: Session, session: SessionRow) -> list[tuple[SessionRow, int | None]]:
    """The session and its ancestors, each with the newest seq the branch below shares of it
    (None for the session itself: all of it)."""
    chain: list[tuple[SessionRow, int | None]] = [(session, None)]
    upto: int | None = None
    while session.parent_id is not None:
        assert session.fork_seq is not None
        upto = session.fork_seq if upto is None else min(upto, session.fork_seq)
        parent = s.get(SessionRow, session.parent_id)
        if parent is None:  # NOTE: a parent is never deleted while it has forks (delete refuses)
            break
        chain.append((parent, upto))
        session = parent
    return chain


def view(s: Session, session: SessionRow) -> list[Seen]:
    """Every message ``session`` sees, in seq order, with its window state for that session."""
    seen: dict[int, Seen] = {}
    for node, upto in reversed(lineage(s, session)):  # the oldest ancestor first: lower ones override
        for mark in s.scalars(select(BranchMarkRow).where(BranchMarkRow.session_id == node.id)):
            if mark.seq in seen and _applies(mark.out_since_seq, mark.replaced_by_seq, upto):
                seen[mark.seq] = Seen(seen[mark.seq].row, False, mark.replaced_by_seq)
        query = select(MessageRow).where(MessageRow.session_id == node.id)
        if upto is not None:
            query = query.where(MessageRow.seq <= upto)
        for row in s.scalars(query):
            out = not row.in_window and _applies(row.out_since_seq, row.replaced_by_seq, upto)
            seen[row.seq] = Seen(row, not out, row.replaced_by_seq if out else None)
    return [seen[seq] for seq in sorted(seen)]


def _applies(out_since_seq: int | None, replaced_by_seq: int | None, upto: int | None) -> bool:
    """Whether a move out of the window had happened by ``upto`` (None: now). A move recorded
    before schema 5 has no ``out_since_seq`` and counts as early."""
    if upto is None:
        return True
    if replaced_by_seq is not None and replaced_by_seq > upto:
        return False
    return out_since_seq is None or out_since_seq <= upto


def last_seq(s: Session, session: SessionRow) -> int:
    """The newest seq the session sees (its own rows continue after its fork point)."""
    own = s.execute(select(func.max(MessageRow.seq)).where(MessageRow.session_id == session.id)).scalar()
    return max(int(own or 0), session.fork_seq or 0)


def move_out(s: Session, session: SessionRow, seqs: Sequence[int], replaced_by_seq: int | None) -> None:
    """Move messages out of the session's window: its own rows are updated, shared ones get a
    branch mark. The seqs are checked by the caller against ``view``."""
    now_seq = last_seq(s, session)
    wanted = set(seqs)
    for row in s.scalars(select(MessageRow).where(MessageRow.session_id == session.id, MessageRow.seq.in_(wanted))):
        row.in_window, row.replaced_by_seq, row.out_since_seq = False, replaced_by_seq, now_seq
        wanted.discard(row.seq)
    for seq in wanted:
        mark = s.get(BranchMarkRow, (session.id, seq)) or BranchMarkRow(session_id=session.id, seq=seq)
        mark.replaced_by_seq, mark.out_since_seq = replaced_by_seq, now_seq
        s.add(mark)
    session.updated_at = utcnow()


def rewind(s: Session, session: SessionRow, after_seq: int) -> int:
    """Take the messages after ``after_seq`` out of the session's window and put back what only
    they had replaced; returns how many left. Rows stay stored (a parent's rows untouched)."""
    seen = view(s, session)
    put_back = [item.row.seq for item in seen if not item.in_window and (item.replaced_by_seq or 0) > after_seq]
    for row in s.scalars(select(MessageRow).where(MessageRow.session_id == session.id,
                                                   MessageRow.seq.in_(put_back))):
        row.in_window, row.replaced_by_seq, row.out_since_seq = True, None, None
    s.execute(delete(BranchMarkRow).where(BranchMarkRow.session_id == session.id,
                                          BranchMarkRow.seq.in_(put_back)))
    s.flush()
    leaving = [item.row.seq for item in seen if item.in_window and item.row.seq > after_seq]
    move_out(s, session, leaving, None)
    return len(leaving)


def fork(s: Session, parent: SessionRow, new_id: str, at: int | None, metadata: dict[str, object]) -> SessionRow:
    """A new session sharing ``parent``'s messages up to ``at`` (default: all of them)."""
    newest = last_seq(s, parent)
    point = newest if at is None else at
    if not 0 <= point <= newest:
        raise UserError(f"session {parent.id!r} has messages 1..{newest}; fork at a seq in 0..{newest}")
    if s.get(SessionRow, new_id) is not None:
        raise SessionExists(new_id)
    now = utcnow()
    row = SessionRow(id=new_id, agent_name=parent.agent_name, created_at=now, updated_at=now, lease_holder=None,
                     lease_expires_at=None, lease_epoch=0, metadata_=metadata, parent_id=parent.id, fork_seq=point)
    s.add(row)
    s.flush()
    return row


def forks_of(s: Session, session_id: str) -> list[str]:
    """Ids of the sessions forked from this one."""
    return list(s.scalars(select(SessionRow.id).where(SessionRow.parent_id == session_id).order_by(SessionRow.id)))
