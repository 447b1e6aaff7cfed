"""OffloadStore: idle sessions' KV kept as keyed blocks in the KV store's tiers — offload is a save, adopt a load.

When a session loses its slot (another needs it, or the paged pool needs room), its KV goes into a
``BlockStore`` as the blocks of its token log, keyed as every saved snapshot is
(``kv/block_keys.py``: tenant salt, model, numerics, the tokens and every token before): a block
the store already holds — the session's own history saved at its last turn end, a system prompt
another session offloaded — is not written again, so an offload after a saved turn copies only its
last few blocks, and sessions sharing a prompt hold it once. The tail (< one block) stays with the
receipt. Bringing the session back loads the longest run of its blocks the tiers still hold; the
session re-prefills the rest (``SlotSession.adopt``). With no store given, the engine keeps its own:
host memory bounded by ``budget_bytes`` (least recently used blocks leave first) and, with a
``spill_dir``, a disk tier behind it. ``Runtime`` hands the engine its ``Store``'s blocks instead
(``use_blocks``), so saved snapshots and offloaded sessions share one host tier::

    store = OffloadStore(budget_bytes=1 << 30, namespace_for=engine.kv_namespace)
    receipt = store.put(snapshot, salt="team-a")   # writes only the blocks no tier holds
    snapshot = receipt.take()                      # the longest prefix still held (None: nothing)

KV whose blocks another session can never share — shifted by a span drop, or without known cuts —
is kept in the same tiers under keys of its own (a namespace private to its receipt), so one byte
budget and one eviction order cover all offloaded KV. Thread-safe.
"""

from __future__ import annotations

import os
import sys
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from agentkv.errors import UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kv.snapshot_cuts import prefix_cuts
from agentkv.kvstore.block_files import DiskBlocks
from agentkv.kvstore.block_store import DURABLE_WAIT_S, BlockStore
from agentkv.kvstore.block_tiers import BlockTier, HostBlocks, TierUsage

__all__ = ["OffloadReceipt", "OffloadStats", "OffloadStore"]

NamespaceFor = Callable[..., KVNamespace]
"""``namespace_for(salt=..., block_size=...)``: the engine's ``kv_namespace``."""


@dataclass(frozen=True)
class OffloadStats:
    """What an ``OffloadStore`` holds now and has done since it was made: ``store.stats().held``."""

    held: int
    """Offloaded sessions (receipts) held now."""
    held_tokens: int
    """Their tokens."""
    offloads: int
    new_bytes: int
    """Block bytes offloads wrote (blocks no tier held yet)."""
    stored_blocks: int
    """Blocks offloads found stored already (the session's saved history, a prompt another holds)."""
    restored_tokens: int
    """Tokens brought back from the tiers."""
    reprefilled_tokens: int
    """Tokens whose blocks had left every tier (evicted, lost, corrupt): re-prefilled instead."""
    prefix_tokens: int
    """Prompt tokens new sessions took from stored blocks instead of prefilling (``find_prefix``)."""
    tiers: tuple[TierUsage, ...]
    """The block store's tiers (host first): bytes, blocks, hits, misses, evictions."""


class OffloadReceipt:
    """One offloaded KV: its blocks' keys, its tail, and what the log was (``OffloadedKV``)."""

    def __init__(self, store: OffloadStore, blocks: BlockStore, snapshot: KVSnapshot, namespace: KVNamespace,
                 keys: tuple[str, ...], tail: KVSnapshot, *, private: bool) -> None:
        """Made by ``OffloadStore.put``: ``blocks`` holds the KV's blocks under ``keys`` (pinned
        there until ``release``), ``tail`` the tokens past the last full block."""
        self.num_tokens = snapshot.num_tokens
        self.namespace = namespace
        self.keys = keys
        """The keys of the log's full blocks, in order."""
        self.private = private
        """Keyed in a namespace of its own (shifted or cut-less KV): removed from the tiers on release."""
        self._shifted, self._cuts, self._lossless = snapshot.shifted, snapshot.cuts, snapshot.lossless
        self._tail = tail
        self._blocks = blocks
        self._store = store
        self._released = False

    def load(self) -> KVSnapshot | None:
        """The whole KV, or None when a block has left the tiers (blocking)."""
        loaded = self._store._load(self)
        return loaded if loaded is not None and loaded.num_tokens == self.num_tokens else None

    def take(self) -> KVSnapshot | None:
        """The longest prefix of the KV the tiers still hold (None: none of it), then ``release``;
        the tokens past it count as re-prefilled (the session feeds them again)."""
        loaded = self._store._load(self)
        self.release()
        self._store._count(restored_tokens=0 if loaded is None else loaded.num_tokens,
                           reprefilled_tokens=self.num_tokens - (0 if loaded is None else loaded.num_tokens))
        return loaded

    def release(self) -> None:
        """Forget the KV: blocks only it needed leave the engine's own tiers (the runtime's store
        keeps shared ones until its collector finds no row naming them). Idempotent."""
        self._store._release(self)

    def _as_logged(self, joined: KVSnapshot) -> KVSnapshot:
        """``joined`` (blocks and maybe the tail) with the log's own flags and cuts."""
        cuts = None if self._cuts is None else prefix_cuts(self._cuts, joined.num_tokens)
        return replace(joined, shifted=self._shifted, lossless=self._lossless and joined.lossless, cuts=cuts)


class OffloadStore:
    """Offloaded KV as keyed blocks in a ``BlockStore``. See the module docstring."""

    def __init__(self, budget_bytes: int | None = None, spill_dir: str | os.PathLike[str] | None = None, *,
                 namespace_for: NamespaceFor | None = None, block_size: int = 32) -> None:
        """``budget_bytes``: host memory for offloaded blocks (None: unbounded); ``spill_dir``: a
        disk tier behind it. ``namespace_for``: the engine's ``kv_namespace`` (set later with
        ``use_namespaces`` when the engine is not built yet)."""
        if budget_bytes is not None and budget_bytes < 0:
            raise UserError(f"offload budget must be >= 0 bytes or None (unbounded), got {budget_bytes}")
        # NOTE: a 0 budget keeps no block in memory (HostBlocks keeps none larger than its bound)
        tiers: list[BlockTier] = [HostBlocks(sys.maxsize if budget_bytes is None else max(1, budget_bytes))]
        if spill_dir is not None:
            tiers.append(DiskBlocks(Path(spill_dir)))
        self.blocks = BlockStore(tiers)
        """Where the blocks live (the runtime's store's blocks after ``use_blocks``)."""
        self._own_blocks = self.blocks
        self.block_size = self._own_block_size = block_size
        self._namespace_for = namespace_for
        self._lock = threading.Lock()
        self._held: set[OffloadReceipt] = set()
        self._counts = dict.fromkeys(("offloads", "new_bytes", "stored_blocks", "restored_tokens",
                                      "reprefilled_tokens", "prefix_tokens"), 0)

    def use_namespaces(self, namespace_for: NamespaceFor) -> None:
        """Key blocks with the engine's ``kv_namespace`` (the engine calls it once built)."""
        self._namespace_for = namespace_for

    def use_blocks(self, blocks: BlockStore, *, block_size: int) -> None:
        """Keep offloaded KV in ``blocks`` from now on (the runtime's store: one host tier for saved
        snapshots and offloaded sessions), until it is closed (then the store's own tiers again);
        KV offloaded before stays where it is until used."""
        with self._lock:
            self.blocks, self.block_size = blocks, block_size

    # ---- offload ---------------------------------------------------------------------------
    def put(self, snapshot: KVSnapshot, *, salt: str = "") -> OffloadReceipt:
        """Keep ``snapshot`` (a session's whole KV) as blocks; blocks already stored are not written
        again (blocking): ``receipt = store.put(snapshot, salt=session.salt)``."""
        if self._namespace_for is None:
            raise UserError("this offload store has no namespace yet: the engine sets it (use_namespaces)")
        private = snapshot.shifted or snapshot.cuts is None
        with self._lock:
            if self.blocks.closed:  # NOTE: the runtime's store closed before us: back to our own
                self.blocks, self.block_size = self._own_blocks, self._own_block_size
            blocks, size = self.blocks, self.block_size
        # NOTE: shifted or cut-less KV matches no other log: keyed in a namespace only its receipt knows
        namespace = self._namespace_for(salt=f"{salt}\x00offloaded {uuid.uuid4().hex}" if private else salt,
                                        block_size=size)
        keyed = replace(snapshot, shifted=False, cuts=()) if private else snapshot
        chain = namespace.chain(keyed.tokens, cuts=keyed.cuts or ())
        saved = blocks.save(keyed, chain)  # NOTE: writes only the blocks no tier is known to hold
        whole = len(chain.keys) * size
        receipt = OffloadReceipt(self, blocks, snapshot, namespace, tuple(chain.keys),
                                 keyed.span(whole, keyed.num_tokens), private=private)
        blocks.pin(receipt.keys)
        with self._lock:
            self._held.add(receipt)
            self._counts["offloads"] += 1
            self._counts["new_bytes"] += saved.new_bytes
            self._counts["stored_blocks"] += saved.blocks - saved.new_blocks
        return receipt

    # ---- prefixes --------------------------------------------------------------------------
    def prefix_room(self, length: int) -> int:
        """Tokens of full blocks a prompt of ``length`` tokens could take from the store, leaving one
        to prefill: a caller skips ``find_prefix`` when that is no more than it holds already."""
        return max(0, (length - 1) // self.block_size * self.block_size)

    def find_prefix(self, tokens: Sequence[int], *, salt: str = "", cuts: Sequence[int] = (),
                    better_than: int = 0) -> KVSnapshot | None:
        """The KV of the longest run of ``tokens``' full blocks the store is known to hold, keyed
        as a cold prefill of ``tokens`` cut at ``cuts`` computes them (another session's system
        prompt and first message, a history a save wrote): None unless it covers more than
        ``better_than`` tokens and leaves one to prefill (blocking):
        ``hit = store.find_prefix(prompt, cuts=[len(system)], better_than=16)``."""
        with self._lock:
            blocks, size = self.blocks, self.block_size
        usable = self.prefix_room(len(tokens))
        if self._namespace_for is None or usable <= better_than or blocks.closed:
            return None
        namespace = self._namespace_for(salt=salt, block_size=size)
        keys = namespace.chain(tokens[:usable], cuts=[c for c in cuts if c < usable]).keys
        known = blocks.first_unknown(keys)  # NOTE: blocks this process wrote or holds: no probe of a remote tier
        if known * size <= better_than:
            return None
        spans = blocks.load(namespace, keys[:known]).spans
        if len(spans) * size <= better_than:
            return None
        with self._lock:
            self._counts["prefix_tokens"] += len(spans) * size
        return KVSnapshot.join(spans)

    # ---- receipts --------------------------------------------------------------------------
    def _load(self, receipt: OffloadReceipt) -> KVSnapshot | None:
        with self._lock:
            if receipt._released:
                return None
        receipt._blocks.wait_written(receipt.keys, DURABLE_WAIT_S)  # NOTE: a block queued for disk is not read
        spans = receipt._blocks.load(receipt.namespace, receipt.keys).spans
        if len(spans) == len(receipt.keys) and receipt._tail.num_tokens:
            spans = [*spans, receipt._tail]
        if not spans:
            return None
        return receipt._as_logged(KVSnapshot.join(spans))

    def _release(self, receipt: OffloadReceipt) -> None:
        with self._lock:
            if receipt._released:
                return
            receipt._released = True
            self._held.discard(receipt)
        unpinned = receipt._blocks.unpin(receipt.keys)
        # NOTE: a private receipt's blocks are nobody else's; nobody else reads the engine's own tiers
        gone = list(receipt.keys) if receipt.private else unpinned if receipt._blocks is self._own_blocks else []
        if gone:
            receipt._blocks.wait_written(gone, DURABLE_WAIT_S)  # a block still queued would land after
            receipt._blocks.remove(gone)

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n

    def stats(self) -> OffloadStats:
        """A consistent copy of the counters: ``engine.backend.pool.host.stats().reprefilled_tokens``."""
        with self._lock:
            held = list(self._held)
            counts = dict(self._counts)
            blocks = self.blocks
        return OffloadStats(held=len(held), held_tokens=sum(r.num_tokens for r in held),
                            tiers=blocks.usage().tiers, **counts)

    def close(self) -> None:
        """Stop the engine's own block store's writers (the runtime's store closes its own)."""
        self._own_blocks.close(timeout=5.0)
