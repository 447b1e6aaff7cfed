"""Branches of a stored conversation: the KV of a fork (live or from a snapshot up its lineage),
a rewind of the window, and the check an edit starts with. ``Runtime.fork``, ``rewind`` and
``edit`` call these::

    branch = await runtime.fork(conversation, at=4)
    left = await runtime.rewind(conversation, before=5)
    branch, result = await runtime.edit(conversation, 3, "Paris?")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

from agentkv.engine.base import KVSession, common_prefix_len
from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.memory.leases import LeaseKeeper
from agentkv.result import ResumeReport
from agentkv.run.conversation import Conversation
from agentkv.run.past_reasoning import reusable_kv_len
from agentkv.kv.block_keys import KVNamespace
from agentkv.runtime.persistence import kv_namespace, load_window, restore_newest_snapshot


async def seed_branch_kv(store: Store, branch: Conversation, *, parent_id: str, fork_seq: int | None,
                         forked: bool, edit: bool) -> None:
    """Bring a new fork's KV to its history: the parent's live KV it was ``forked`` from,
    trimmed where the fork's history leaves it, else the newest snapshot up its lineage that
    shares a prefix; ``branch.resume_report`` says what came back. ``edit=True``: the fork
    replaces what follows (its first call reports the KV it dropped):
    ``await seed_branch_kv(store, branch, parent_id="abc", fork_seq=4, forked=True, edit=False)``."""
    agent = branch.agent
    prompt = branch.render(agent, add_generation_prompt=False).token_ids
    skipped: tuple[str, ...] = ()
    if forked:
        if edit:
            branch.note_break(agent, "edit")
        restored = reusable_kv_len(branch.renderer, agent, branch.engine, branch.kv.tokens, prompt)
        await branch.kv.trim(restored)
    else:
        restored, skipped = await restore_from_lineage(store, parent_id, branch.kv, prompt, branch.engine.fingerprint,
                                                       partial(reusable_kv_len, branch.renderer, agent, branch.engine),
                                                       namespace=kv_namespace(store, branch))
    branch.resume_report = ResumeReport(len(branch.window), restored, skipped)
    branch.call_checks.note(f"fork of {parent_id} at message {fork_seq}: {restored} tokens of KV "
                            f"{'from its live KV' if forked else 'from a snapshot'}")


async def restore_from_lineage(store: Store, conversation_id: str | None, kv: KVSession, prompt: tuple[int, ...],
                               fingerprint: str,
                               reusable: Callable[[Sequence[int], Sequence[int]], int] = common_prefix_len,
                               *, namespace: KVNamespace | None = None) -> tuple[int, tuple[str, ...]]:
    """Restore into ``kv`` the newest snapshot of the nearest conversation up from
    ``conversation_id`` (itself, its parent, ...) that has one sharing a prefix with ``prompt``;
    returns the tokens restored and why snapshots were passed over:
    ``restored, skipped = await restore_from_lineage(store, "abc", kv, prompt, engine.fingerprint)``."""
    skipped: list[str] = []
    while conversation_id is not None:
        restored = await restore_newest_snapshot(store, conversation_id, kv, prompt, fingerprint, reusable,
                                                 namespace=namespace)
        skipped += restored.skipped
        if restored.tokens:
            return restored.tokens, tuple(skipped)
        conversation_id = (await store.get_conversation(conversation_id)).parent_id
    return 0, tuple(skipped)


async def rewind_window(store: Store, conversation: Conversation, before: int, *, holder: str,
                        lease_ttl_s: float) -> int:
    """Take message ``before`` (a seq) and every later one out of ``conversation``'s window
    (they stay stored) under its run guard and lease, and trim the KV to where the window now
    diverges; returns how many messages left:
    ``await rewind_window(store, conversation, 5, holder=runtime.holder, lease_ttl_s=60)``."""
    if before < 1:
        raise UserError(f"before must be a message seq >= 1, got {before}")
    async with conversation.run_guard(), LeaseKeeper(store, conversation.id, holder, ttl_s=lease_ttl_s) as lease:
        conversation.lease_token = lease.token
        left = await store.rewind(conversation.id, before - 1, fence=lease.token)
        conversation.reload_window(await load_window(store, conversation.id))
        conversation.call_checks.note(f"rewind before message {before}")
        found = conversation.note_break(conversation.agent, "rewind")
        if found is not None:
            await conversation.kv.trim(found.position)
    return left


async def check_user_message(store: Store, conversation_id: str, seq: int) -> None:
    """``UserError`` unless message ``seq`` of the conversation is a user message (what an
    edit replaces): ``await check_user_message(store, "abc", 3)``."""
    stored = {m.seq: m for m in await store.messages(conversation_id)}
    if seq not in stored or stored[seq].message.role != "user":
        users = sorted(n for n, m in stored.items() if m.message.role == "user")
        raise UserError(f"message {seq} of conversation {conversation_id!r} is not a user message; "
                        f"user messages: {users}")
