"""Bridges conversations and the store: record messages, lease runs, snapshot KV after a turn, resume.

Runtime-level glue (it knows Conversation and Store; the store itself knows neither the
engine nor the runner). Used by ``Runtime`` when it is given a store::

    runtime = Runtime(engine, store=Store.from_env(), agents=[agent])
    conversation = await runtime.resume(conversation_id)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import anyio

from agentkv.chat.messages import Message, pending_tool_calls
from agentkv.engine.base import KVSession, common_prefix_len
from agentkv.errors import LeaseLost, SnapshotCorrupt, SnapshotIncompatible
from agentkv.events import CacheBroken, ContextCompacted, ModelCallFinished, RunEvent
from agentkv.kv.block_keys import KVNamespace
from agentkv.memory import CallRecord, Store
from agentkv.memory.unstored_kv import read_unstored_kv
from agentkv.observe import tracing
from agentkv.observe.cache_breaks import CacheBreak
from agentkv.observe.metrics import SNAPSHOTS
from agentkv.result import ResumeReport
from agentkv.run.approvals import needs_approval
from agentkv.run.conversation import Conversation, WindowEntry
from agentkv.run.past_reasoning import reusable_kv_len

logger = logging.getLogger(__name__)

__all__ = ["CallLog", "Restored", "ResumeReport", "StoreSink", "StoreWindowHook", "catch_up_from_snapshot",
           "kv_namespace",
           "load_window", "record_interrupted_calls", "restore_newest_snapshot", "save_snapshot",
           "save_snapshot_unless_stored"]


class StoreSink:
    """The ``MessageSink`` that appends each recorded message to the store."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def __call__(self, conversation: Conversation, message: Message, token_count: int, in_window: bool) -> int:
        stored = await self.store.append_message(conversation.id, message, token_count=token_count,
                                                 in_window=in_window, fence=conversation.lease_token)
        return stored.seq


class StoreWindowHook:
    """The ``WindowChange`` hook: a replacement (summary, cut message) is appended and the
    messages leaving the window are marked out of it, linked to their replacement — in one
    transaction, so a crash in between cannot leave both in the window."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def __call__(self, conversation: Conversation, removed: list[WindowEntry],
                       replacement: WindowEntry | None) -> None:
        seqs = [entry.seq for entry in removed if entry.seq is not None]
        if replacement is not None:
            stored = await self.store.replace_in_window(
                conversation.id, seqs, replacement.message, token_count=replacement.token_count,
                fence=conversation.lease_token,
            )
            replacement.seq = stored.seq
        elif seqs:
            await self.store.mark_out_of_window(conversation.id, seqs, fence=conversation.lease_token)


async def load_window(store: Store, conversation_id: str) -> list[WindowEntry]:
    """The messages still in the window, in window order: a summary stands where the first
    message it replaced stood (it was appended later, so seq order alone would misplace it)."""
    stored = await store.messages(conversation_id)
    replaced: dict[int, list[int]] = {}
    for item in stored:
        if item.replaced_by_seq is not None:
            replaced.setdefault(item.replaced_by_seq, []).append(item.seq)
    position: dict[int, int] = {}

    def place(seq: int) -> int:
        if seq not in position:
            position[seq] = min((place(r) for r in replaced.get(seq, ())), default=seq)
        return position[seq]

    window = sorted((s for s in stored if s.in_window), key=lambda s: (place(s.seq), s.seq))
    return [WindowEntry(s.message, s.seq, s.token_count) for s in window]


INTERRUPTED_RESULT = "error: interrupted (the process stopped before the tool returned)"


async def record_interrupted_calls(conversation: Conversation) -> int:
    """Record an ``INTERRUPTED_RESULT`` for every call of the agent's own tools in the window
    that has no result (a process died mid-tool), so the history is a valid message sequence
    again; returns how many. Calls of caller-executed tools wait for the caller's results, and
    calls waiting for approval for a decision (an approved call whose run died waits again).
    Idempotent: a call that has a result is left alone.

    NOTE: results are appended at the end, which is where a crash leaves its orphans (the
    last assistant turn); the caller holds the conversation's lease.
    """
    agent = conversation.agent  # calls the caller answers, or a person approves, are pending by design
    orphans = [call for call in pending_tool_calls(conversation.messages).values()
               if call.name not in agent.external_tool_names and not needs_approval(agent, call)]
    for call in orphans:
        await conversation.record(Message.tool(INTERRUPTED_RESULT, tool_call_id=call.id, name=call.name))
    if orphans:
        logger.warning("conversation %s: %d tool call(s) had no result (interrupted); recorded one each",
                       conversation.id, len(orphans))
    return len(orphans)


async def save_snapshot(store: Store, conversation: Conversation) -> None:
    """Snapshot the conversation's KV to a file and reference it (a failure is one warning line,
    never raised: it only costs a longer prefill on resume).

    Only the part of the KV that the stored history renders to is kept: after a failed or
    cancelled run the KV also holds a partial answer that no later prompt starts with, and a
    snapshot of it could never be restored.
    """
    try:
        usable = _snapshot_worthy_len(conversation)
        if usable == 0:
            return
        with tracing.span("agentkv.snapshot.save", conversation.trace_span, conversation_id=conversation.id) as span:
            namespace = kv_namespace(store, conversation)
            snapshot, log = await read_unstored_kv(store.blocks, conversation.kv, namespace, usable)
            await store.save_snapshot(conversation.id, snapshot, fence=conversation.lease_token,
                                      tenant=conversation.salt, namespace=namespace, log=log)
            SNAPSHOTS.saves += 1
            span.set(tokens=snapshot.num_tokens, bytes=snapshot.nbytes, precision=snapshot.precision)
    except Exception as error:  # NOTE: no traceback: a full disk would print one every turn
        logger.warning("could not save a KV snapshot of conversation %s (%s: %s); %s", conversation.id,
                       type(error).__name__, error, await _what_resume_uses(store, conversation))


async def save_snapshot_unless_stored(store: Store, conversation: Conversation) -> bool:
    """``save_snapshot``, unless the newest stored snapshot of this model already holds as much of
    the KV (the one every run leaves at its end, normally); True when it saved. What a server does
    before it exits, so a replica that drains leaves every open conversation restorable::

        await save_snapshot_unless_stored(store, conversation)
    """
    try:
        usable = _snapshot_worthy_len(conversation)
        stored = [r for r in await store.snapshots(conversation.id) if r.fingerprint == conversation.engine.fingerprint]
    except Exception as error:
        logger.warning("could not tell whether conversation %s has a snapshot (%s: %s); saving one",
                       conversation.id, type(error).__name__, error)
    else:
        if usable == 0 or (stored and stored[0].num_tokens >= usable):
            return False
    await save_snapshot(store, conversation)
    return True


async def catch_up_from_snapshot(store: Store, conversation: Conversation) -> int:
    """After another process ran ``conversation`` (its stored window changed under it): restore the
    newest snapshot when it holds more of the history than the conversation's own KV (which would
    otherwise realign by prefix and re-read the rest); returns the tokens restored (0: KV kept)::

        if conversation.reload_window(await load_window(store, conversation.id)):
            await catch_up_from_snapshot(store, conversation)
    """
    fingerprint = conversation.engine.fingerprint
    held = _snapshot_worthy_len(conversation)
    newest = [r for r in await store.snapshots(conversation.id) if r.fingerprint == fingerprint]
    if not newest or newest[0].num_tokens <= held:
        return 0
    prompt = conversation.render(conversation.agent, add_generation_prompt=False).token_ids
    restored = await restore_newest_snapshot(
        store, conversation.id, conversation.kv, prompt, fingerprint,
        partial(reusable_kv_len, conversation.renderer, conversation.agent, conversation.engine),
        better_than=held, namespace=kv_namespace(store, conversation))
    if restored.tokens:
        logger.info("conversation %s: another process ran it; restored its newest snapshot (%d tokens, %d held here)",
                    conversation.id, restored.tokens, held)
    return restored.tokens


def kv_namespace(store: Store, conversation: Conversation) -> KVNamespace:
    """The namespace the store keys ``conversation``'s KV blocks in (its engine, tenant and the
    store's block size): ``await store.save_snapshot(..., namespace=kv_namespace(store, conversation))``."""
    return conversation.engine.kv_namespace(salt=conversation.salt, block_size=store.block_size)


def _snapshot_worthy_len(conversation: Conversation) -> int:
    """Tokens of the conversation's KV a snapshot keeps: what its stored history renders to."""
    history = conversation.render(conversation.agent, add_generation_prompt=False).token_ids
    return reusable_kv_len(conversation.renderer, conversation.agent, conversation.engine,
                           conversation.kv.tokens, history)


async def _what_resume_uses(store: Store, conversation: Conversation) -> str:
    """What a resume of ``conversation`` would restore now, as the end of a warning line."""
    try:
        records = await store.snapshots(conversation.id)
    except Exception as error:
        return f"the store cannot say which older snapshot a resume would use ({error})"
    fingerprint = conversation.engine.fingerprint
    # NOTE: in a worker thread: on S3 each check is a request
    usable = await anyio.to_thread.run_sync(lambda: [
        r for r in records if r.fingerprint == fingerprint and store.files.looks_whole(str(r.path), r.nbytes)])
    if not usable:
        return "no older snapshot exists: a resume will prefill its history from the start"
    newest = usable[0]
    return (f"a resume will use the older snapshot of {newest.num_tokens} tokens from "
            f"{newest.created_at:%Y-%m-%d %H:%M:%S} UTC and prefill the rest")


@dataclass(frozen=True)
class Restored:
    """What ``restore_newest_snapshot`` brought back."""

    tokens: int
    """Tokens of KV restored (a prefix of the prompt; 0: none)."""
    held: int
    """Tokens the newest stored snapshot of this model held: the KV the conversation had when it
    was last saved (0: no snapshot). Restoring fewer than this lost KV: a cache break."""
    skipped: tuple[str, ...]
    """Why snapshots were passed over."""
    sources: Mapping[str, int] = field(default_factory=dict)
    """Tokens of the restored KV each place gave (``Store.load_snapshot``'s ``sources``: "host",
    "disk", "s3" for blocks, "snapshot" for a snapshot file or object), before any trim to ``tokens``."""


async def restore_newest_snapshot(
    store: Store, conversation_id: str, kv: KVSession, prompt: tuple[int, ...], fingerprint: str,
    reusable: Callable[[Sequence[int], Sequence[int]], int] = common_prefix_len, *, better_than: int = 0,
    namespace: KVNamespace | None = None,
) -> Restored:
    """Restore into ``kv`` the newest valid snapshot that shares a prefix with ``prompt`` — the
    whole snapshot, or its part up to where they diverge (a rewound or forked history), as
    ``reusable(snapshot_tokens, prompt)`` measures it (default: the common prefix; a reasoning
    model's conversation also keeps the thinking its template leaves out: ``reusable_kv_len``).

    A corrupt or missing file, or one from another model, is skipped and logged: the conversation
    then re-prefills, losing nothing. ``better_than``: the tokens ``kv`` already holds of the prompt;
    a snapshot that would not restore more is passed over (and ``kv`` kept). ``namespace``: the one
    the conversation's KV blocks are keyed in (``kv_namespace``); without it a snapshot saved as blocks
    is passed over.
    """
    skipped: list[str] = []
    held = 0
    for record in await store.snapshots(conversation_id):
        if record.fingerprint != fingerprint:
            skipped.append(f"{record.path.name}: made by another model ({record.fingerprint})")
            continue
        held = held or record.num_tokens
        sources: dict[str, int] = {}
        try:
            snapshot = await store.load_snapshot(record, expected_fingerprint=fingerprint, namespace=namespace,
                                                 sources=sources)
        except (SnapshotCorrupt, SnapshotIncompatible) as error:
            logger.warning("skipping snapshot %s of conversation %s: %s", record.path, conversation_id, error)
            skipped.append(f"{record.path.name}: {error}")
            continue
        shared = reusable(snapshot.tokens, prompt)
        if shared <= better_than:
            skipped.append(f"{record.path.name}: it shares {shared} tokens with the rendered history"
                           + (f", not more than the {better_than} held" if better_than else ""))
            continue
        with tracing.span("agentkv.snapshot.restore", conversation_id=conversation_id, tokens=shared,
                          bytes=record.nbytes, precision=record.precision):
            await kv.restore(snapshot if shared == snapshot.num_tokens else snapshot.prefix(shared))
        SNAPSHOTS.restores += 1
        return Restored(shared, held, tuple(skipped), sources)
    return Restored(0, held, tuple(skipped))


class CallLog:
    """Records each model call of a stored run (``calls`` table) from the run's events: its
    metrics, the cache break and the compaction before it. A failed write is logged, never
    raised (figures are not worth a run)::

        log = CallLog(store, conversation.id, fence=conversation.lease_token)
        async for event in events:
            await log.see(event)
    """

    def __init__(self, store: Store, conversation_id: str, *, fence: int | None = None) -> None:
        """``fence``: the run's lease token (a run that lost its lease records no more calls)."""
        self.store, self.conversation_id, self.fence = store, conversation_id, fence
        self._break: CacheBreak | None = None
        self._compaction: dict[str, object] | None = None

    async def see(self, event: RunEvent) -> None:
        if isinstance(event, CacheBroken):
            self._break = self._break or event.cache_break
        elif isinstance(event, ContextCompacted):
            self._compaction = {"policy": event.policy, "tokens_before": event.tokens_before,
                                "tokens_after": event.tokens_after, "messages_removed": event.messages_removed,
                                "fallback": event.fallback}
        elif isinstance(event, ModelCallFinished):
            m = event.metrics
            found, self._break = self._break, None
            compaction, self._compaction = self._compaction, None
            record = CallRecord(
                conversation_id=self.conversation_id, prompt_tokens=m.prompt_tokens, reused_tokens=m.reused_tokens,
                prefix_cache_tokens=m.prefix_cache_tokens, prefilled_tokens=m.prefilled_tokens,
                generated_tokens=m.generated_tokens, ttft_s=m.ttft_s, tpot_s=m.tpot_s, kv_tokens=m.kv_tokens,
                kv_bytes=m.kv_bytes, compaction=compaction,
                cache_break=found.as_json() if found else None, forced_tokens=m.forced_tokens,
                drafted_tokens=m.drafted_tokens, accepted_tokens=m.accepted_tokens, steps_saved=m.steps_saved)
            try:
                await self.store.record_call(record, fence=self.fence)
            except LeaseLost as error:
                logger.warning("did not record a model call of conversation %s: %s", self.conversation_id, error)
            except Exception:
                logger.warning("could not record a model call of conversation %s", self.conversation_id, exc_info=True)
