"""KV found by a prompt's tokens: conversations sent whole (chat completions) restore on any replica.

A stored conversation finds its KV through its snapshot rows; a conversation a client resends whole
each turn has no row, and before this its KV lived only in the process that ran it. After each of
its turns the server saves the KV's full blocks (``BlockStore``: each written once, whoever shares
it) and indexes them by ``KVNamespace.token_keys`` — digests of the tokens alone — beside their
block keys and parents (``kv_prompt_blocks``). A replica that has no live conversation for a request
looks its prompt's token keys up, follows one chain of blocks (each the child of the one before,
so blocks of differently computed logs never mix), loads what the tiers hold and prefills the rest::

    saved = await save_prompt_kv(store, space, await session.snapshot())
    found = await load_prompt_kv(store, space, prompt_ids)     # None: nothing stored
    if found is not None:
        await session.restore(found.snapshot)               # found.restored_from: tokens per tier

The answers in such a conversation come back as text; the token ids the model generated are kept
too (``keep_answer_tokens``), so another replica renders a resent answer to the tokens its KV holds.
Rows a save has not named for ``PROMPT_BLOCKS_KEPT`` go at the next ``Store.prune``, and the blocks
only they named with them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from functools import partial

import anyio.to_thread
from sqlalchemy import select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from agentkv.kv.block_codec import join_blocks
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory.retention import PROMPT_BLOCKS_KEPT
from agentkv.memory.schema import AnswerTokensRow, PromptBlockRow, utcnow
from agentkv.memory.store import Store
from agentkv.memory.unstored_kv import LogOfSpan

__all__ = ["PROMPT_BLOCKS_KEPT", "FoundPromptKV", "find_answer_tokens", "keep_answer_tokens", "load_prompt_kv",
           "save_prompt_kv"]


@dataclass(frozen=True)
class FoundPromptKV:
    """What ``load_prompt_kv`` found: ``found.snapshot``, ``found.restored_from["s3"]``."""

    snapshot: KVSnapshot
    """The KV of the prompt's longest stored prefix (whole blocks)."""
    restored_from: dict[str, int]
    """Its tokens by the tier that gave them ("host", "disk", "s3")."""


async def save_prompt_kv(store: Store, namespace: KVNamespace, snapshot: KVSnapshot,
                         log: LogOfSpan | None = None) -> int:
    """Save ``snapshot``'s full blocks and index them by their tokens; returns the blocks indexed
    (0 for KV that cannot be keyed: unknown cuts, or shifted by a RoPE drop). ``log``: the whole
    log's tokens and cuts when ``snapshot`` is its span from the first unstored block
    (``read_unstored_kv``)."""
    if snapshot.cuts is None or snapshot.shifted:
        return 0
    tokens, cuts = (snapshot.tokens, snapshot.cuts) if log is None else log
    chain = namespace.chain(tokens, cuts=cuts)
    if not chain.keys:
        return 0
    start = len(tokens) - snapshot.num_tokens
    await anyio.to_thread.run_sync(partial(store.blocks.save_durably, snapshot, chain, start=start))
    token_keys = namespace.token_keys(tokens)

    def record(s: Session) -> None:
        _record(s, namespace.id, token_keys, chain.keys, utcnow())

    try:
        await store.database.run(store.database.write, record)
    except IntegrityError:  # NOTE: another replica indexed the same blocks at the same moment
        await store.database.run(store.database.write, record)
    return len(chain.keys)


async def load_prompt_kv(store: Store, namespace: KVNamespace, tokens: Sequence[int], *,
                         better_than: int = 0) -> FoundPromptKV | None:
    """The KV of the longest prefix of ``tokens`` whose blocks are indexed and still held (whole
    blocks only; None when there is none, or when the index holds no more than ``better_than``
    tokens of it: what a live conversation already has)."""
    token_keys = namespace.token_keys(tokens)
    if len(token_keys) * namespace.block_size <= better_than:
        return None
    keys = await store.database.run(store.database.read, lambda s: _chain(s, namespace.id, token_keys))
    if len(keys) * namespace.block_size <= better_than:
        return None
    loaded = await anyio.to_thread.run_sync(store.blocks.load, namespace, keys)
    return FoundPromptKV(join_blocks(loaded.spans), loaded.tokens_by_tier()) if loaded.spans else None


def _record(s: Session, namespace: str, token_keys: Sequence[str], block_keys: Sequence[str], now: datetime) -> None:
    """Index each block under its token key (new rows added, rows already there touched)."""
    rows = s.execute(select(PromptBlockRow.token_key, PromptBlockRow.block_key)
                     .where(PromptBlockRow.namespace == namespace, PromptBlockRow.token_key.in_(token_keys))).all()
    known = {(token_key, block_key) for token_key, block_key in rows}
    parent = namespace
    for token_key, block_key in zip(token_keys, block_keys):
        if (token_key, block_key) not in known:
            s.add(PromptBlockRow(namespace=namespace, token_key=token_key, block_key=block_key,
                                 parent_key=parent, used_at=now))
        parent = block_key
    s.execute(update(PromptBlockRow)
              .where(PromptBlockRow.namespace == namespace, PromptBlockRow.block_key.in_(block_keys))
              .values(used_at=now).execution_options(synchronize_session=False))


def _chain(s: Session, namespace: str, token_keys: Sequence[str]) -> list[str]:
    """Block keys for the leading token keys, each block the child of the one before (of several
    candidates, the one saved most recently)."""
    rows = s.execute(select(PromptBlockRow.token_key, PromptBlockRow.block_key, PromptBlockRow.parent_key,
                            PromptBlockRow.used_at)
                     .where(PromptBlockRow.namespace == namespace, PromptBlockRow.token_key.in_(token_keys))).all()
    by_token: dict[str, list[tuple[datetime, str, str]]] = defaultdict(list)
    for token_key, block_key, parent_key, used_at in rows:
        by_token[token_key].append((used_at, block_key, parent_key))
    chain: list[str] = []
    parent = namespace
    for token_key in token_keys:
        children = sorted((c for c in by_token.get(token_key, ()) if c[2] == parent), reverse=True)
        if not children:
            break
        parent = children[0][1]
        chain.append(parent)
    return chain


async def keep_answer_tokens(store: Store, answers: Mapping[str, Sequence[int]]) -> None:
    """Keep generated answers' token ids by their answer key (``{key: ids}``), for any replica."""
    if not answers:
        return

    def keep(s: Session) -> None:
        now = utcnow()
        known = set(s.scalars(select(AnswerTokensRow.answer_key).where(AnswerTokensRow.answer_key.in_(answers))))
        for key, ids in answers.items():
            if key not in known:
                s.add(AnswerTokensRow(answer_key=key, token_ids=[int(t) for t in ids], used_at=now))
        s.execute(update(AnswerTokensRow).where(AnswerTokensRow.answer_key.in_(known)).values(used_at=now)
                  .execution_options(synchronize_session=False))

    try:
        await store.database.run(store.database.write, keep)
    except IntegrityError:  # NOTE: another replica kept the same answer at the same moment
        await store.database.run(store.database.write, keep)


async def find_answer_tokens(store: Store, keys: Sequence[str]) -> dict[str, tuple[int, ...]]:
    """The token ids kept for the answer keys among ``keys``: ``{key: ids}``."""
    if not keys:
        return {}

    def read(s: Session) -> dict[str, tuple[int, ...]]:
        rows = s.execute(select(AnswerTokensRow.answer_key, AnswerTokensRow.token_ids)
                         .where(AnswerTokensRow.answer_key.in_(list(keys)))).all()
        return {key: tuple(int(t) for t in ids) for key, ids in rows}

    return await store.database.run(store.database.read, read)
