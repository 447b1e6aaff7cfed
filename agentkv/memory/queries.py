"""The SQL of each store operation: synchronous functions run inside one transaction.

Each takes an ORM ``Session`` whose transaction the caller (``Store``) opened and commits;
raising rolls the whole operation back. Rows are turned into records before returning.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import ColumnElement, case, delete, func, or_, select, update
from sqlalchemy.orm import Session

from agentkv.chat.messages import Message
from agentkv.errors import (
    AgentNotFound,
    LeaseLost,
    ResponseNotFound,
    ResponseSuperseded,
    ConversationBusy,
    ConversationExists,
    ConversationNotFound,
    UserError,
)
from agentkv.memory import branches, convert
from agentkv.memory.holders import holder_is_dead_here
from agentkv.memory.records import (
    AgentRecord,
    CallRecord,
    ResponseRecord,
    ConversationRecord,
    ConversationSummary,
    StoredMessage,
)
from agentkv.memory.schema import (
    AgentRow,
    CallRow,
    MessageRow,
    ResponseRow,
    ConversationRow,
    SnapshotRow,
    WindowMoveRow,
    utcnow,
)


def upsert_agent(s: Session, name: str, instructions: str | None, tool_names: list[str],
                 settings: dict[str, Any]) -> None:
    row = s.get(AgentRow, name)
    if row is None:
        row = AgentRow(name=name)
        s.add(row)
    row.instructions = instructions or ""
    row.system_turn = instructions is not None
    row.tool_names = tool_names
    row.settings = settings
    row.updated_at = utcnow()


def get_agent(s: Session, name: str) -> AgentRecord:
    row = s.get(AgentRow, name)
    if row is None:
        raise AgentNotFound(name)
    return convert.agent_record(row)


def create_conversation(s: Session, agent_name: str, conversation_id: str,
                        metadata: dict[str, Any]) -> ConversationRecord:
    if s.get(AgentRow, agent_name) is None:
        raise AgentNotFound(agent_name)
    if s.get(ConversationRow, conversation_id) is not None:
        raise ConversationExists(conversation_id)
    now = utcnow()
    row = ConversationRow(id=conversation_id, agent_name=agent_name, created_at=now, updated_at=now,
                          lease_holder=None, lease_expires_at=None, lease_epoch=0, metadata_=metadata, window_version=0)
    s.add(row)
    s.flush()
    return convert.conversation_record(row)


def conversation_row(s: Session, conversation_id: str, *, for_update: bool = False) -> ConversationRow:
    """The conversation's row (locked on PostgreSQL with ``for_update``); ``ConversationNotFound`` if absent."""
    query = select(ConversationRow).where(ConversationRow.id == conversation_id)
    if for_update:
        query = query.with_for_update()
    row = s.execute(query).scalar_one_or_none()
    if row is None:
        raise ConversationNotFound(conversation_id)
    return row


def fenced_row(s: Session, conversation_id: str, fence: int | None) -> ConversationRow:
    """The conversation's row, locked for a write by the holder of lease ``fence`` (its fencing
    token; None: an unfenced write); ``LeaseLost`` once the lease has passed to another holder
    since — checked in the write's own transaction, so no write of a past holder lands after."""
    row = conversation_row(s, conversation_id, for_update=True)
    if fence is not None and row.lease_epoch != fence:
        raise LeaseLost(conversation_id, row.lease_holder)
    return row


def list_conversations(s: Session) -> list[ConversationSummary]:
    in_window_tokens = case((MessageRow.in_window.is_(True), MessageRow.token_count), else_=0)
    query = (
        select(ConversationRow, func.count(MessageRow.seq),
               func.coalesce(func.sum(MessageRow.token_count), 0),
               func.coalesce(func.sum(in_window_tokens), 0))
        .outerjoin(MessageRow, MessageRow.conversation_id == ConversationRow.id)
        .group_by(ConversationRow.id)
        .order_by(ConversationRow.updated_at.desc(), ConversationRow.id)
    )
    return [
        ConversationSummary(id=row.id, agent_name=row.agent_name, created_at=row.created_at,
                            updated_at=row.updated_at, message_count=int(count),
                            total_tokens=int(total), in_window_tokens=int(in_window),
                            parent_id=row.parent_id, fork_seq=row.fork_seq)
        for row, count, total, in_window in s.execute(query)
    ]


def append_message(s: Session, conversation_id: str, message: Message, token_count: int,
                   in_window: bool, fence: int | None = None) -> StoredMessage:
    # NOTE: the row lock (PostgreSQL) or BEGIN IMMEDIATE (SQLite) serialises appends to one
    # conversation, so max(seq) + 1 is unique without a retry loop.
    conversation = fenced_row(s, conversation_id, fence)
    now = utcnow()
    row = MessageRow(conversation_id=conversation_id, seq=branches.last_seq(s, conversation) + 1,
                     token_count=token_count, in_window=True, replaced_by_seq=None, created_at=now,
                     window_version=conversation.window_version,
                     **convert.message_fields(message))
    s.add(row)
    conversation.updated_at = now
    s.flush()
    if not in_window:  # stored out of the window: a move of its own, as any other
        branches.move_out(s, conversation, [row.seq], None)
        s.flush()
    return convert.stored_message(row)


def messages(s: Session, conversation_id: str, in_window_only: bool) -> list[StoredMessage]:
    """The messages the conversation sees (a fork: its parent's up to its fork point, then its own)."""
    seen = branches.view(s, conversation_row(s, conversation_id))
    return [convert.stored_message(item.row, in_window=item.in_window, replaced_by_seq=item.replaced_by_seq)
            for item in seen if item.in_window or not in_window_only]


def mark_out_of_window(s: Session, conversation_id: str, seqs: Sequence[int],
                       replaced_by_seq: int | None, fence: int | None = None) -> None:
    conversation = fenced_row(s, conversation_id, fence)
    wanted = set(seqs) | ({replaced_by_seq} if replaced_by_seq is not None else set())
    found = {item.row.seq for item in branches.view(s, conversation)}
    if missing := sorted(wanted - found):
        raise UserError(f"conversation {conversation_id!r} has no messages with seq {missing}")
    if replaced_by_seq is not None and replaced_by_seq in seqs:
        raise UserError(f"message {replaced_by_seq} cannot replace itself")
    branches.move_out(s, conversation, seqs, replaced_by_seq)


def rewind(s: Session, conversation_id: str, after_seq: int, keep_responses: bool = False,
           fence: int | None = None) -> int:
    """Take the messages after ``after_seq`` out of the window, and put back those that only
    they had replaced (a summary made after it); returns how many left. Rows stay stored.
    ``keep_responses``: ``ResponseSuperseded`` instead when a stored response covers a later message;
    ``fence`` as for ``fenced_row``."""
    conversation = fenced_row(s, conversation_id, fence)
    if keep_responses:
        newer = s.scalars(select(ResponseRow).where(ResponseRow.conversation_id == conversation_id,
                                                    ResponseRow.last_seq > after_seq)
                          .order_by(ResponseRow.last_seq.desc()).limit(1)).first()
        if newer is not None:
            raise ResponseSuperseded(conversation_id, newer.id)
    return branches.rewind(s, conversation, after_seq)


def fork_conversation(s: Session, conversation_id: str, new_id: str, at: int | None,
                      metadata: dict[str, Any], fence: int | None = None) -> ConversationRecord:
    parent = fenced_row(s, conversation_id, fence)
    return convert.conversation_record(branches.fork(s, parent, new_id, at, metadata))


def delete_conversation(s: Session, conversation_id: str, fence: int | None = None) -> list[str]:
    """Delete the conversation's rows; return the snapshot file names to remove after commit.
    ``UserError`` while forks share its messages; ``fence`` as for ``fenced_row``."""
    fenced_row(s, conversation_id, fence)
    if forks := branches.forks_of(s, conversation_id):
        raise UserError(f"conversation {conversation_id!r} has forks that share its messages ({', '.join(forks)}); "
                        "delete them first; nothing was deleted")
    s.execute(delete(WindowMoveRow).where(WindowMoveRow.conversation_id == conversation_id))
    s.execute(delete(CallRow).where(CallRow.conversation_id == conversation_id))
    names = list(s.scalars(select(SnapshotRow.path).where(SnapshotRow.conversation_id == conversation_id)))
    s.execute(delete(SnapshotRow).where(SnapshotRow.conversation_id == conversation_id))
    s.execute(delete(ResponseRow).where(ResponseRow.conversation_id == conversation_id))
    s.execute(delete(MessageRow).where(MessageRow.conversation_id == conversation_id))
    s.execute(delete(ConversationRow).where(ConversationRow.id == conversation_id))
    return names


def last_seq(s: Session, conversation_id: str) -> int:
    """The seq of the newest message the conversation sees (0 for none)."""
    return branches.last_seq(s, conversation_row(s, conversation_id))


def acquire_lease(s: Session, conversation_id: str, holder: str, ttl_s: float, now: datetime) -> tuple[int, str | None]:
    """Take or renew the lease at time ``now``; ``ConversationBusy`` while another live holder has it.

    Returns the lease's fencing token, and the holder id of a dead process on this host whose
    lease was taken over (else None).
    """
    expires = now + timedelta(seconds=ttl_s)
    for _ in range(3):  # a holder may release between our UPDATE and our read: try again
        if _claim_lease(s, conversation_id, holder, expires, _free_or_ours(holder, now)):
            return _epoch(s, conversation_id), None
        current = lease_holder(s, conversation_id)
        if current is None:
            continue
        if not holder_is_dead_here(current):
            raise ConversationBusy(conversation_id, current)
        # NOTE: the takeover names the exact dead holder we read, so of two processes racing
        # to take it over only one UPDATE matches; the other sees the winner and is busy.
        if _claim_lease(s, conversation_id, holder, expires, ConversationRow.lease_holder == current):
            return _epoch(s, conversation_id), current
    raise ConversationBusy(conversation_id, lease_holder(s, conversation_id))


def renew_lease(s: Session, conversation_id: str, holder: str, fence: int, ttl_s: float, now: datetime) -> None:
    """Extend the lease ``holder`` took with token ``fence`` to ``now + ttl_s`` (also once expired,
    while nobody took it); ``LeaseLost`` when it was released or passed to another holder since."""
    expires = now + timedelta(seconds=ttl_s)
    ours = (ConversationRow.lease_holder == holder) & (ConversationRow.lease_epoch == fence)
    if not _claim_lease(s, conversation_id, holder, expires, ours):
        raise LeaseLost(conversation_id, lease_holder(s, conversation_id))


def _epoch(s: Session, conversation_id: str) -> int:
    return int(s.execute(select(ConversationRow.lease_epoch).where(ConversationRow.id == conversation_id)).scalar_one())


def _free_or_ours(holder: str, now: datetime) -> ColumnElement[bool]:
    return or_(ConversationRow.lease_holder.is_(None), ConversationRow.lease_expires_at < now,
               ConversationRow.lease_holder == holder)


def _claim_lease(s: Session, conversation_id: str, holder: str, expires: datetime,
                 condition: ColumnElement[bool]) -> bool:
    """One conditional UPDATE: atomic on SQLite and PostgreSQL alike, whoever races us. The
    fencing token counts up when the lease passes to another holder (a renewal keeps it)."""
    passes = case((ConversationRow.lease_holder == holder, ConversationRow.lease_epoch),
                  else_=ConversationRow.lease_epoch + 1)
    result = s.execute(
        update(ConversationRow)
        .where(ConversationRow.id == conversation_id, condition)
        .values(lease_holder=holder, lease_expires_at=expires, lease_epoch=passes)
        .execution_options(synchronize_session=False)
    )
    return result.rowcount == 1  # type: ignore[attr-defined, no-any-return]


def lease_holder(s: Session, conversation_id: str, *, live_at: datetime | None = None) -> str | None:
    """The conversation's lease holder (None if free, or expired at ``live_at`` when it is given).

    Reads the columns, not the ORM row: a row cached earlier in this transaction would not
    show our own UPDATEs. ``ConversationNotFound`` if the conversation is absent.
    """
    found = s.execute(select(ConversationRow.lease_holder, ConversationRow.lease_expires_at)
                      .where(ConversationRow.id == conversation_id)).one_or_none()
    if found is None:
        raise ConversationNotFound(conversation_id)
    holder, expires_at = found
    if live_at is not None and (expires_at is None or expires_at < live_at):
        return None
    return holder


def release_lease(s: Session, conversation_id: str, holder: str) -> None:
    """Free the lease if ``holder`` has it; otherwise (or for an unknown conversation) do nothing."""
    s.execute(
        update(ConversationRow)
        .where(ConversationRow.id == conversation_id, ConversationRow.lease_holder == holder)
        .values(lease_holder=None, lease_expires_at=None)
        .execution_options(synchronize_session=False)
    )


def force_release_lease(s: Session, conversation_id: str) -> str | None:
    """Free the lease whoever holds it; return the holder recorded before (maybe expired). The
    fencing token moves on: that holder's later writes are refused."""
    row = conversation_row(s, conversation_id, for_update=True)
    previous = row.lease_holder
    row.lease_holder = None
    row.lease_expires_at = None
    if previous is not None:
        row.lease_epoch += 1
    return previous


def add_response(s: Session, response_id: str, conversation_id: str, owner: str,
                 body: dict[str, Any], fence: int | None = None) -> ResponseRecord:
    """Insert a response that covers the conversation's messages so far; ``UserError`` for a taken id,
    ``LeaseLost`` once lease ``fence`` has passed to another holder."""
    fenced_row(s, conversation_id, fence)
    if s.get(ResponseRow, response_id) is not None:
        raise UserError(f"a response {response_id!r} is already stored; use a new id")
    row = ResponseRow(id=response_id, conversation_id=conversation_id, owner=owner,
                      last_seq=last_seq(s, conversation_id), body=body, created_at=utcnow())
    s.add(row)
    s.flush()
    return convert.response_record(row)


def response_row(s: Session, response_id: str, owner: str) -> ResponseRow:
    """The response of ``owner``; ``ResponseNotFound`` when absent or another owner's (the same
    error, so an id tells nothing about other tenants)."""
    row = s.get(ResponseRow, response_id)
    if row is None or row.owner != owner:
        raise ResponseNotFound(response_id)
    return row


def delete_response(s: Session, response_id: str, owner: str, now: datetime) -> tuple[bool, list[str]]:
    """Delete a response; when it was its conversation's last, the conversation goes too. Returns whether
    the conversation went, and the snapshot file names to remove after commit. ``ConversationBusy`` while a
    live holder (a run, maybe in another process) has the conversation's lease: nothing is deleted."""
    row = response_row(s, response_id, owner)
    conversation_id = row.conversation_id
    conversation_row(s, conversation_id, for_update=True)
    holder = lease_holder(s, conversation_id, live_at=now)
    if holder is not None and not holder_is_dead_here(holder):
        raise ConversationBusy(conversation_id, holder)
    s.delete(row)
    s.flush()
    remaining = s.execute(select(func.count()).select_from(ResponseRow)
                          .where(ResponseRow.conversation_id == conversation_id)).scalar()
    if remaining:
        return False, []
    return True, delete_conversation(s, conversation_id)


def responses_of(s: Session, conversation_id: str) -> list[ResponseRecord]:
    """The conversation's responses, newest (highest ``last_seq``) first."""
    conversation_row(s, conversation_id)
    rows = s.scalars(select(ResponseRow).where(ResponseRow.conversation_id == conversation_id)
                     .order_by(ResponseRow.last_seq.desc(), ResponseRow.created_at.desc()))
    return [convert.response_record(row) for row in rows]



def add_call(s: Session, record: CallRecord, fence: int | None = None) -> CallRecord:
    if fence is None:
        conversation_row(s, record.conversation_id)
    else:
        fenced_row(s, record.conversation_id, fence)
    row = convert.call_row(record)
    row.created_at = utcnow()
    s.add(row)
    s.flush()
    return convert.call_record(row)


def calls(s: Session, conversation_id: str) -> list[CallRecord]:
    conversation_row(s, conversation_id)
    rows = s.scalars(select(CallRow).where(CallRow.conversation_id == conversation_id).order_by(CallRow.id))
    return [convert.call_record(row) for row in rows]
