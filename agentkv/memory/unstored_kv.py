"""Read from a KV session only what the block store does not hold yet: the span from its first unstored block.

Both places that keep a conversation's KV — a stored conversation's snapshot at a turn's end
(``runtime/persistence.py``) and a chat completion's prompt blocks (``memory/prompt_kv.py``) — key
the conversation's log from its tokens and cuts, ask the store for the first block no tier holds, and
read the KV from there only (``KVSession.snapshot(start=)``): a turn reads its new KV, not the
whole history::

    span, log = await read_unstored_kv(store.blocks, conversation, space, usable=len(session.tokens))
    await store.save_snapshot(sid, span, namespace=space, log=log)     # log None: span is the whole KV
"""

from __future__ import annotations

from agentkv.engine.base import KVSession
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kvstore.block_store import BlockStore

__all__ = ["LogOfSpan", "read_unstored_kv"]

LogOfSpan = tuple[tuple[int, ...], tuple[int, ...]]
"""The whole log's tokens and cuts, when a snapshot is only its span from a block bound."""


async def read_unstored_kv(blocks: BlockStore, kv: KVSession, namespace: KVNamespace,
                           usable: int) -> tuple[KVSnapshot, LogOfSpan | None]:
    """The KV of ``kv``'s first ``usable`` tokens from the first block ``blocks`` does not hold, and
    the log it is a span of (None: the span is the whole KV — a conversation that keeps no cuts, a
    shifted KV, or nothing stored yet)."""
    start, log = 0, None
    cuts = getattr(kv, "cuts", None)  # NOTE: a conversation without cuts (a test's stand-in) is read whole
    if cuts is not None and not kv.shifted:
        tokens = tuple(kv.tokens[:usable])
        inside = tuple(c for c in cuts if c < usable)
        start = blocks.first_unknown(namespace.chain(tokens, cuts=inside).keys) * namespace.block_size
        log = (tokens, inside) if start else None
    snapshot = await kv.snapshot(start=start)
    if usable - start < snapshot.num_tokens:
        snapshot = snapshot.prefix(usable - start)
    return snapshot, log
