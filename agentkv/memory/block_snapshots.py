"""Read back a snapshot saved as keyed blocks: the leading run of blocks the tiers hold, then its tail file.

A row with ``block_keys`` names the blocks of its KV's full blocks (shared with earlier turns and
other conversations) and a file holding only the tail after them. Reading it gives the whole KV
when every block is still held, else the KV of the blocks up to the first one missing (a crash
lost it from the write-behind queue, the collector or a bounded tier dropped it, it was corrupt):
the caller restores that prefix and re-prefills the rest from the history::

    snapshot = load_block_snapshot(store.blocks, record, partial(files.load, ...), namespace)
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible
from agentkv.kv.block_codec import join_blocks
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kvstore.block_store import BlockStore
from agentkv.memory.records import SnapshotRecord

__all__ = ["SNAPSHOT_FILE", "load_block_snapshot"]

SNAPSHOT_FILE = "snapshot"
"""The source name of KV read from a snapshot file or object (a whole snapshot, or a tail)."""

logger = logging.getLogger("agentkv.store")


def load_block_snapshot(blocks: BlockStore, record: SnapshotRecord, load_tail: Callable[[], KVSnapshot],
                        namespace: KVNamespace | None, sources: dict[str, int] | None = None) -> KVSnapshot:
    """The KV ``record`` holds that ``blocks`` and its tail file still give back (see the module
    docstring); ``sources``, when given, gets the tokens each tier gave (``"snapshot"``: the tail
    file's). ``SnapshotIncompatible`` without the namespace it was saved in (another tenant, block
    size or numerics); ``SnapshotCorrupt`` when not even its first block is held."""
    if namespace is None or namespace.id != record.kv_namespace or namespace.block_size != record.block_size:
        raise SnapshotIncompatible(
            f"KV snapshot {record.path} is stored as {record.block_size}-token blocks of namespace "
            f"{record.kv_namespace}, not this engine's and tenant's; the conversation re-prefills from its history")
    loaded = blocks.load(namespace, record.block_keys)
    spans = loaded.spans
    if sources is not None:
        sources.update(loaded.tokens_by_tier())
    if len(spans) == len(record.block_keys):
        tail = load_tail()
        if sources is not None and tail.num_tokens:
            sources[SNAPSHOT_FILE] = tail.num_tokens
        return join_blocks([*spans, tail]) if spans else tail
    if not spans:
        raise SnapshotCorrupt(f"no block of KV snapshot {record.path} is held in any tier any more "
                              f"({len(record.block_keys)} blocks); the conversation re-prefills from its history")
    held = len(spans) * namespace.block_size
    logger.warning("KV snapshot %s: %d of its %d blocks are held (%d of %d tokens); the rest is re-prefilled",
                   record.path, len(spans), len(record.block_keys), held, record.num_tokens)
    return join_blocks(spans)
