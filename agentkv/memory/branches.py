"""Branches in SQL: a fork shares its parent's messages up to ``fork_seq`` without copying a row,
and each conversation sees the window of what it shares as it was at its fork point, plus its own moves.

Every change of a conversation's window (a compaction, a truncation, a rewind) is one *window version*
of that conversation, stored as append-only ``window_moves`` rows (one per message moved in or out).
A fork records its parent's version at the fork point (``fork_version``) and reads the parent's
moves up to it, then its own; a move the parent makes later — a rewind putting messages back
included — is the parent's alone. A message's row records the version its conversation had when it
was appended, which is what a fork at the seq before it reads up to::

    rows = view(s, conversation_id)          # [Seen(row, in_window, replaced_by_seq)] in seq order
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from agentkv.errors import ConversationExists, UserError
from agentkv.memory.schema import MessageRow, ConversationRow, WindowMoveRow, utcnow


@dataclass(frozen=True)
class Seen:
    """A message as one conversation sees it."""

    row: MessageRow
    in_window: bool
    replaced_by_seq: int | None


@dataclass(frozen=True)
class Shared:
    """A conversation of the reader's lineage and how much of it the reader sees."""

    node: ConversationRow
    upto_seq: int | None
    """The newest of its messages the reader sees (None: the reader itself, all of them)."""
    upto_version: int | None
    """The newest of its window versions the reader sees (None: all)."""


def lineage(s: Session, conversation: ConversationRow) -> list[Shared]:
    """The conversation and its ancestors, each with the newest seq and window version the branch
    below shares of it. NOTE: where a branch further down forked at an earlier seq than the
    one above it, it sees an ancestor as it was just before that seq's next message."""
    chain = [Shared(conversation, None, None)]
    upto_seq: int | None = None
    upto_version: int | None = None
    child = conversation
    while child.parent_id is not None:
        assert child.fork_seq is not None and child.fork_version is not None
        parent = s.get(ConversationRow, child.parent_id)
        if parent is None:  # NOTE: a parent is never deleted while it has forks (delete refuses)
            break
        if upto_seq is None or child.fork_seq <= upto_seq:
            upto_seq, upto_version = child.fork_seq, child.fork_version
        else:
            upto_version = version_before(s, parent, upto_seq + 1)
        chain.append(Shared(parent, upto_seq, upto_version))
        child = parent
    return chain


def version_before(s: Session, conversation: ConversationRow, seq: int) -> int:
    """The conversation's window version when it appended message ``seq``: the moves up to it came
    before. 0 (none of its moves) when ``seq`` is a row it shares: it was appended before the
    conversation existed."""
    stamp = s.execute(select(MessageRow.window_version)
                      .where(MessageRow.conversation_id == conversation.id, MessageRow.seq == seq)).scalar()
    return 0 if stamp is None else int(stamp)


def view(s: Session, conversation: ConversationRow) -> list[Seen]:
    """Every message ``session`` sees, in seq order, with its window state for that session."""
    rows: dict[int, MessageRow] = {}
    state: dict[int, tuple[bool, int | None]] = {}
    for shared in reversed(lineage(s, conversation)):  # the oldest ancestor first: later moves override
        node, upto_seq, upto_version = shared.node, shared.upto_seq, shared.upto_version
        query = select(MessageRow).where(MessageRow.conversation_id == node.id)
        moves = select(WindowMoveRow).where(WindowMoveRow.conversation_id == node.id)
        if upto_seq is not None:
            query = query.where(MessageRow.seq <= upto_seq)
            moves = moves.where(WindowMoveRow.seq <= upto_seq)
        if upto_version is not None:
            moves = moves.where(WindowMoveRow.version <= upto_version)
        rows.update((row.seq, row) for row in s.scalars(query))
        for move in s.scalars(moves.order_by(WindowMoveRow.version)):
            if move.seq in rows:
                state[move.seq] = (move.in_window, move.replaced_by_seq)
    return [Seen(rows[seq], *state.get(seq, (True, None))) for seq in sorted(rows)]


def last_seq(s: Session, conversation: ConversationRow) -> int:
    """The newest seq the conversation sees (its own rows continue after its fork point)."""
    own = s.execute(select(func.max(MessageRow.seq)).where(MessageRow.conversation_id == conversation.id)).scalar()
    return max(int(own or 0), conversation.fork_seq or 0)


def move(s: Session, conversation: ConversationRow, changes: dict[int, tuple[bool, int | None]]) -> None:
    """Record one window version of the conversation: each seq moves in or out (``(in_window,
    replaced_by_seq)``). Its own rows' flags follow; the rows it shares are left as their conversation
    has them. The seqs are checked by the caller against ``view``."""
    if not changes:
        return
    conversation.window_version += 1
    version = conversation.window_version
    s.add_all(WindowMoveRow(conversation_id=conversation.id, version=version, seq=seq, in_window=inside,
                            replaced_by_seq=replaced_by)
              for seq, (inside, replaced_by) in changes.items())
    for row in s.scalars(select(MessageRow).where(MessageRow.conversation_id == conversation.id,
                                                  MessageRow.seq.in_(list(changes)))):
        row.in_window, row.replaced_by_seq = changes[row.seq]
    conversation.updated_at = utcnow()


def move_out(s: Session, conversation: ConversationRow, seqs: Iterable[int], replaced_by_seq: int | None) -> None:
    """Move messages out of the conversation's window, replaced by ``replaced_by_seq`` (a summary) or
    by nothing (a truncation); one window version."""
    move(s, conversation, {seq: (False, replaced_by_seq) for seq in seqs})


def rewind(s: Session, conversation: ConversationRow, after_seq: int) -> int:
    """Take the messages after ``after_seq`` out of the conversation's window and put back the ones up
    to it that a later message had replaced; returns how many left. One window version of this
    conversation: rows stay stored, and no other conversation's window changes."""
    changes: dict[int, tuple[bool, int | None]] = {}
    for item in view(s, conversation):
        seq = item.row.seq
        if seq > after_seq and item.in_window:
            changes[seq] = (False, None)
        elif seq <= after_seq and not item.in_window and (item.replaced_by_seq or 0) > after_seq:
            changes[seq] = (True, None)
    move(s, conversation, changes)
    return sum(1 for inside, _ in changes.values() if not inside)


def fork(s: Session, parent: ConversationRow, new_id: str, at: int | None,
         metadata: dict[str, object]) -> ConversationRow:
    """A new conversation sharing ``parent``'s messages up to ``at`` (default: all of them), with the
    parent's window as it is now (``at`` its newest seq) or as it was when message ``at + 1`` came."""
    newest = last_seq(s, parent)
    point = newest if at is None else at
    if not 0 <= point <= newest:
        raise UserError(f"conversation {parent.id!r} has messages 1..{newest}; fork at a seq in 0..{newest}")
    if s.get(ConversationRow, new_id) is not None:
        raise ConversationExists(new_id)
    version = parent.window_version if point == newest else version_before(s, parent, point + 1)
    now = utcnow()
    row = ConversationRow(id=new_id, agent_name=parent.agent_name, created_at=now, updated_at=now, lease_holder=None,
                          lease_expires_at=None, lease_epoch=0, metadata_=metadata, parent_id=parent.id, fork_seq=point,
                          window_version=0, fork_version=version)
    s.add(row)
    s.flush()
    return row


def forks_of(s: Session, conversation_id: str) -> list[str]:
    """Ids of the conversations forked from this one."""
    return list(s.scalars(select(ConversationRow.id).where(ConversationRow.parent_id == conversation_id)
                          .order_by(ConversationRow.id)))
