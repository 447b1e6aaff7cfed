"""Bridges agent sessions and the store: record messages, lease runs, snapshot KV after a turn, resume.

Runtime-level glue (it knows AgentSession and Store; the store itself knows neither the
engine nor the runner). Used by ``Runtime`` when it is given a store::

    runtime = Runtime(engine, store=Store.from_env(), agents=[agent])
    session = await runtime.resume(session_id)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from agentkv.chat.messages import Message
from agentkv.conversation import AgentSession, WindowEntry
from agentkv.engine.base import KVSession
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible
from agentkv.memory import Store

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ResumeReport:
    """What a resume found: the messages loaded and how the KV came back."""

    messages: int
    """Messages put back into the window."""
    restored_tokens: int
    """Tokens whose KV came from a snapshot (0: the next call re-prefills)."""
    skipped_snapshots: tuple[str, ...] = ()
    """Why snapshots were passed over (corrupt, another model, stale)."""


class StoreSink:
    """The ``MessageSink`` that appends each recorded message to the store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def __call__(self, session: AgentSession, message: Message, token_count: int, in_window: bool) -> int:
        stored = await self.store.append_message(session.id, message, token_count=token_count, in_window=in_window)
        return stored.seq


async def load_window(store: Store, session_id: str) -> list[WindowEntry]:
    """The messages still in the window, as stored (summaries included)."""
    stored = await store.messages(session_id, in_window_only=True)
    return [WindowEntry(s.message, s.seq, s.token_count) for s in stored]


async def save_snapshot(store: Store, session: AgentSession) -> None:
    """Snapshot the session's KV to a file and reference it (failures are logged, never raised)."""
    try:
        if not session.kv.tokens:
            return
        snapshot = await session.kv.snapshot()
        await store.save_snapshot(session.id, snapshot)
    except Exception:  # a failed snapshot only costs a re-prefill later
        logger.warning("could not snapshot session %s; it will re-prefill on resume", session.id, exc_info=True)


async def restore_newest_snapshot(
    store: Store, session_id: str, kv: KVSession, prompt: tuple[int, ...], fingerprint: str
) -> tuple[int, tuple[str, ...]]:
    """Restore into ``kv`` the newest valid snapshot whose tokens are a prefix of ``prompt``.

    Returns (tokens restored, reasons snapshots were skipped). A corrupt or missing file, or
    one from another model, is skipped and logged: the session then re-prefills, losing nothing.
    """
    skipped: list[str] = []
    for record in await store.snapshots(session_id):
        if record.fingerprint != fingerprint:
            skipped.append(f"{record.path.name}: made by another model ({record.fingerprint})")
            continue
        try:
            snapshot = await store.load_snapshot(record, expected_fingerprint=fingerprint)
        except (SnapshotCorrupt, SnapshotIncompatible) as error:
            logger.warning("skipping snapshot %s of session %s: %s", record.path, session_id, error)
            skipped.append(f"{record.path.name}: {error}")
            continue
        if tuple(prompt[: snapshot.num_tokens]) != tuple(snapshot.tokens):
            skipped.append(f"{record.path.name}: its tokens are not a prefix of the rendered history")
            continue
        await kv.restore(snapshot)
        return snapshot.num_tokens, tuple(skipped)
    return 0, tuple(skipped)
