"""Persistence: agents, conversations, append-only messages, leases and KV snapshot files (SQLAlchemy).

``from agentkv.memory import Store``; the store never sees OpenVINO objects, only
``KVSnapshot`` arrays and chat ``Message`` models.
"""

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
from agentkv.memory.store import ENV_DB_URL, Store

__all__ = [
    "ENV_DB_URL",
    "AgentRecord",
    "CallRecord",
    "PruneReport",
    "ResponseRecord",
    "ConversationRecord",
    "ConversationSummary",
    "SnapshotRecord",
    "StoredMessage",
    "Store",
]
