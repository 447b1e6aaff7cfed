"""Conversions between ORM rows and the store's records / chat messages."""

from __future__ import annotations

import json
from typing import Any

from agentkv.chat.messages import Message
from agentkv.errors import UserError
from agentkv.memory.records import (
    AgentRecord,
    CallRecord,
    ResponseRecord,
    ConversationRecord,
    SnapshotRecord,
    StoredMessage,
)
from agentkv.memory.schema import AgentRow, CallRow, MessageRow, ResponseRow, ConversationRow, SnapshotRow
from agentkv.memory.snapshots import SnapshotStorage


def json_object(value: dict[str, Any] | None, what: str) -> dict[str, Any]:
    """``value`` as a JSON-safe dict (a copy); raises ``UserError`` if it is not JSON."""
    if value is None:
        return {}
    try:
        return dict(json.loads(json.dumps(value)))
    except (TypeError, ValueError) as e:
        raise UserError(f"{what} must be JSON-serialisable (str, numbers, lists, dicts): {e}") from e


def agent_record(row: AgentRow) -> AgentRecord:
    return AgentRecord(name=row.name, instructions=row.instructions if row.system_turn else None,
                       tool_names=tuple(row.tool_names), settings=dict(row.settings),
                       updated_at=row.updated_at)


def conversation_record(row: ConversationRow) -> ConversationRecord:
    return ConversationRecord(id=row.id, agent_name=row.agent_name, created_at=row.created_at,
                              updated_at=row.updated_at, lease_holder=row.lease_holder,
                              lease_expires_at=row.lease_expires_at, metadata=dict(row.metadata_),
                              parent_id=row.parent_id, fork_seq=row.fork_seq)


def message_fields(message: Message) -> dict[str, Any]:
    """The message columns of a ``MessageRow`` for ``message``."""
    return {
        "role": message.role,
        "content": message.content,
        "tool_calls": [call.model_dump(mode="json") for call in message.tool_calls],
        "tool_call_id": message.tool_call_id,
        "name": message.name,
        "token_ids": None if message.token_ids is None else list(message.token_ids),
        "reasoning": message.reasoning,
    }


def stored_message(row: MessageRow, *, in_window: bool | None = None, replaced_by_seq: int | None = None
                   ) -> StoredMessage:
    """The row as a record; ``in_window`` / ``replaced_by_seq`` as the reading conversation sees them
    (a fork's view of a shared message), else the row's own."""
    message = Message.model_validate({
        "role": row.role,
        "content": row.content,
        "tool_calls": row.tool_calls,
        "tool_call_id": row.tool_call_id,
        "name": row.name,
        "token_ids": row.token_ids,
        "reasoning": row.reasoning,
    })
    own = in_window is None
    return StoredMessage(conversation_id=row.conversation_id, seq=row.seq, message=message,
                         token_count=row.token_count, in_window=bool(row.in_window if own else in_window),
                         replaced_by_seq=row.replaced_by_seq if own else replaced_by_seq, created_at=row.created_at)


def snapshot_record(row: SnapshotRow, files: SnapshotStorage) -> SnapshotRecord:
    return SnapshotRecord(id=row.id, conversation_id=row.conversation_id, num_tokens=row.num_tokens,
                          token_hash=row.token_hash, fingerprint=row.fingerprint,
                          precision=row.precision, path=files.resolve(row.path),
                          checksum=row.checksum, nbytes=row.nbytes, shifted=bool(row.shifted),
                          created_at=row.created_at, block_keys=tuple((row.block_keys or "").split()),
                          block_size=row.block_size, kv_namespace=row.kv_namespace)


def response_record(row: ResponseRow) -> ResponseRecord:
    return ResponseRecord(id=row.id, conversation_id=row.conversation_id, owner=row.owner, last_seq=row.last_seq,
                          body=dict(row.body), created_at=row.created_at)


CALL_FIELDS = ("prompt_tokens", "reused_tokens", "prefix_cache_tokens", "prefilled_tokens", "generated_tokens",
               "ttft_s", "tpot_s", "kv_tokens", "kv_bytes", "cache_break", "compaction",
               "forced_tokens", "drafted_tokens", "accepted_tokens", "steps_saved")


def call_row(record: CallRecord) -> CallRow:
    return CallRow(conversation_id=record.conversation_id, **{name: getattr(record, name) for name in CALL_FIELDS})


def call_record(row: CallRow) -> CallRecord:
    return CallRecord(conversation_id=row.conversation_id, id=row.id, created_at=row.created_at,
                      **{name: getattr(row, name) for name in CALL_FIELDS})
