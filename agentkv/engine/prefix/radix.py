"""PrefixCache: a radix tree of token ids whose nodes hold their edge's KV, shared by every session.

A long system prompt + tool schemas is prefilled once; every later session that starts with
it copies its KV instead of recomputing it. Shared prefixes are stored once (a node holds the
KV of its edge's tokens only)::

    cache = PrefixCache(fingerprint=engine.fingerprint, budget_bytes=256 << 20)   # lossless "auto"
    cache.register(system_ids)                     # a boundary worth caching
    cache.insert(system_ids, keys, values, cuts=[])   # float32 [layers, batch, heads, T, head_dim]
    hit = cache.lookup(system_ids + question_ids, longer_than=0)   # KVSnapshot of system_ids

The engine calls ``lookup`` before a prefill and ``capture`` after it. A match may end inside
an edge: with causal attention the KV of a prefix is the prefix of the KV. Keys live in a
namespace (model fingerprint, tenant salt). Each edge's snapshot keeps the cuts of the KV it
holds (where the passes that computed it began, ``KVSnapshot.span``), so a hit gives back the
cuts with the KV; an edge stored after a path whose KV was cut otherwise has unknown cuts (None:
a hybrid no single run computed). Leaves are evicted under a byte budget in the
order an ``EvictionPolicy`` gives (LRU by default); nodes held by a ``PrefixLease`` never are.
Every public method is thread-safe (one ``threading.Lock``, held for tree edits, not for the
precision conversion or the copies).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

import anyio
import numpy as np

from agentkv.engine.base import common_prefix_len
from agentkv.engine.prefix.kv_chunks import captured_cuts, join_chunks
from agentkv.engine.prefix.stats import CapturableSession, PrefixCacheStats, ReadableSlot
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.snapshot import KVSnapshot, PrecisionChoice
from agentkv.kv.snapshot_cuts import Cuts, join_cuts, prefix_cuts, span_cuts
from agentkv.errors import UserError

Namespace = tuple[str, str]
"""(model fingerprint, tenant salt): caches in different namespaces never share KV."""


@dataclass(eq=False)
class PrefixNode:
    """One edge of the tree: its tokens and their KV (the root has neither)."""

    edge: tuple[int, ...]
    """Token ids on the edge from the parent to this node."""
    kv: KVSnapshot | None
    """KV of ``edge`` (positions follow the parent's), in the cache's precision."""
    parent: PrefixNode | None = None
    children: dict[int, PrefixNode] = field(default_factory=dict)
    """Children by the first token of their edge."""
    last_used: int = 0
    """Logical clock of the last insert or hit through this node."""
    leases: set[PrefixLease] = field(default_factory=set)
    """Leases holding this node: it is not evicted while any is open."""

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.nbytes


class EvictionPolicy(Protocol):
    """Orders evictable leaves: the lowest priority goes first."""

    def priority(self, node: PrefixNode) -> float:
        """Sort key of ``node`` (read-only)."""
        ...


class LRUPolicy:
    """Least recently used first."""

    def priority(self, node: PrefixNode) -> float:
        return float(node.last_used)


class PrefixLease:
    """Receipt for a matched prefix: its nodes are not evicted until ``release()`` (idempotent).

    ::

        with cache.acquire(prompt) as lease:
            if lease.num_tokens:
                snapshot = lease.snapshot()
    """

    def __init__(self, cache: PrefixCache, tokens: tuple[int, ...], chunks: list[KVSnapshot]) -> None:
        self._cache = cache
        self.tokens = tokens
        """The matched prefix (empty on a miss)."""
        self._chunks = chunks
        self._nodes: list[PrefixNode] = []

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def snapshot(self) -> KVSnapshot:
        """The matched prefix's KV as one snapshot (copies when it spans several nodes)."""
        if not self._chunks:
            raise UserError("this lease matched nothing; check lease.num_tokens before snapshot()")
        return join_chunks(self._chunks)

    def release(self) -> None:
        """Let the nodes be evicted again. Releasing twice is harmless."""
        self._cache._release(self)

    def __enter__(self) -> PrefixLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class PrefixCache:
    """Radix tree token prefix → KV, LRU by bytes. See the module docstring for a call."""

    def __init__(
        self,
        *,
        fingerprint: str,
        budget_bytes: int | None = 256 << 20,
        precision: PrecisionChoice = "auto",
        policy: EvictionPolicy | None = None,
        limiter: anyio.CapacityLimiter | None = None,
        boundaries: PrefixBoundaries | None = None,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise UserError(f"budget_bytes must be >= 0 or None (unbounded), got {budget_bytes}")
        if precision not in ("auto", "f32", "bf16", "f16", "u8"):
            raise UserError(f"precision must be one of auto, f32, bf16, f16, u8, not {precision!r}")
        self.fingerprint = fingerprint
        self.budget_bytes = budget_bytes
        self.precision: PrecisionChoice = precision
        """Storage of cached KV: "auto" keeps it bit-exact at the smallest size."""
        self.boundaries = boundaries or PrefixBoundaries()
        """The registered prefixes (shared with the engine's canonical chunking)."""
        self._policy = policy or LRUPolicy()
        self._limiter = limiter
        self._lock = threading.Lock()
        self._roots: dict[Namespace, PrefixNode] = {}
        self._clock = itertools.count(1)
        self._bytes = 0
        self._counts = dict.fromkeys(("hits", "misses", "hit_tokens", "inserted_tokens", "evictions",
                                      "evicted_bytes"), 0)

    # ---- registration and capture ----------------------------------------------------
    def register(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Mark ``tokens`` as a prefix worth caching; ``capture`` stores it once a session has read it."""
        self.boundaries.register(tokens, salt=salt)

    async def capture(self, session: CapturableSession, slot: ReadableSlot, *, salt: str = "") -> int:
        """Store the registered prefixes that ``session``'s KV now covers and the cache lacks.

        The caller holds the session's lock and slot lease. Reads the slot in a worker thread
        only when something is missing. Returns the tokens newly stored.
        """
        if session.shifted or not session.kv_exact:  # close to, not equal to, a fresh prefill: never share it
            return 0
        wanted = self._uncached_marks(session.tokens, salt)
        if not wanted:
            return 0
        cuts = captured_cuts(session, len(wanted[-1]))
        return await anyio.to_thread.run_sync(self._capture_blocking, slot, wanted, salt, cuts,
                                              limiter=self._limiter)

    def _uncached_marks(self, tokens: tuple[int, ...], salt: str) -> list[tuple[int, ...]]:
        """Registered prefixes of ``tokens`` not fully cached, shortest first."""
        ns = (self.fingerprint, salt)
        marks = self.boundaries.prefixes_of(tokens, salt=salt)
        with self._lock:
            return [m for m in marks if self._walk(ns, m)[1] < len(m)]

    def _capture_blocking(self, slot: ReadableSlot, wanted: list[tuple[int, ...]], salt: str, cuts: Cuts) -> int:
        keys, values = slot.read()  # float32 [layers, batch, heads, T, head_dim]
        return sum(self.insert(m, keys[:, :, :, : len(m)], values[:, :, :, : len(m)], salt=salt,
                               cuts=prefix_cuts(cuts, len(m))) for m in wanted)

    # ---- insert ----------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, *, salt: str = "",
               cuts: Sequence[int] | None = None) -> int:
        """Cache the KV of ``tokens`` (float32 ``[layers, batch, heads, len(tokens), head_dim]``),
        computed by passes beginning at ``cuts`` (``KVLog.cuts``; None: unknown).

        Blocking (converts to the cache precision). Stores only the part not cached yet; does
        nothing if that part cannot fit the budget. Returns the tokens newly stored.
        """
        key = tuple(int(t) for t in tokens)
        if keys.ndim != 5 or keys.shape != values.shape or keys.shape[3] != len(key):
            raise UserError(f"keys/values must be [layers, batch, heads, {len(key)}, head_dim], got {keys.shape}")
        ns = (self.fingerprint, salt)
        known = None if cuts is None else tuple(sorted({int(c) for c in cuts if 0 < c < len(key)}))
        with self._lock:
            start = self._walk(ns, key)[1]
        if start >= len(key):
            return 0
        chunk = self._convert(key, keys, values, start, len(key), known)  # NOTE: outside the lock
        with self._lock:
            return self._attach(ns, key, keys, values, start, chunk, known)

    def _convert(self, key: tuple[int, ...], keys: np.ndarray, values: np.ndarray, start: int, stop: int,
                 cuts: Cuts) -> KVSnapshot:
        return KVSnapshot.from_float(
            key[start:stop], keys[:, :, :, start:stop], values[:, :, :, start:stop],
            precision=self.precision, fingerprint=self.fingerprint, cuts=span_cuts(cuts, start, stop),
        )

    def _attach(self, ns: Namespace, key: tuple[int, ...], keys: np.ndarray, values: np.ndarray,
                start: int, chunk: KVSnapshot, cuts: Cuts) -> int:
        """Hang ``chunk`` (the KV of ``key[start:]``, cut at ``cuts``) under the longest cached prefix of ``key``."""
        path, matched = self._walk(ns, key)
        if matched >= len(key):
            return 0
        if matched > start:  # another thread stored part of it meanwhile
            chunk = chunk.span(matched - start, len(key) - start)
        elif matched < start:  # part of it was evicted meanwhile
            chunk = join_chunks([self._convert(key, keys, values, matched, start, cuts), chunk])
        if chunk.cuts is not None and _path_cuts(path) != prefix_cuts(cuts, matched):
            chunk = replace(chunk, cuts=None)  # computed after KV cut otherwise than the cached path's
        parent = self._roots.setdefault(ns, PrefixNode(edge=(), kv=None))
        if path:
            parent, taken = path[-1]
            if taken < len(parent.edge):
                self._split(parent, taken)
        ancestors = {id(n) for n, _ in path}
        if not self._make_room(chunk.nbytes, protect=ancestors):
            return 0
        tick = next(self._clock)
        leaf = PrefixNode(edge=chunk.tokens, kv=chunk, parent=parent, last_used=tick)
        parent.children[chunk.tokens[0]] = leaf
        for node, _ in path:
            node.last_used = tick
        self._bytes += chunk.nbytes
        self._counts["inserted_tokens"] += chunk.num_tokens
        return chunk.num_tokens

    def _split(self, node: PrefixNode, at: int) -> None:
        """Cut ``node``'s edge at ``at``: it keeps ``edge[:at]``; a new child takes the rest."""
        assert node.kv is not None and 0 < at < len(node.edge)
        lower = PrefixNode(
            edge=node.edge[at:], kv=node.kv.span(at, len(node.edge)), parent=node,
            children=node.children, last_used=node.last_used, leases=set(node.leases),
        )
        for child in lower.children.values():
            child.parent = lower
        for lease in node.leases:
            lease._nodes.append(lower)
        before = node.nbytes
        node.edge, node.kv, node.children = node.edge[:at], node.kv.span(0, at), {lower.edge[0]: lower}
        self._bytes += node.nbytes + lower.nbytes - before

    # ---- lookup ----------------------------------------------------------------------
    def acquire(self, prompt: Sequence[int], *, longer_than: int = 0, salt: str = "") -> PrefixLease:
        """Lease the longest cached prefix of ``prompt`` if it is longer than ``longer_than`` tokens.

        NOTE: the match stops at ``len(prompt) - 1``: a prompt fully covered by the cache still
        needs its last token fed to get logits. A miss returns an empty lease (``num_tokens == 0``).
        """
        key = tuple(int(t) for t in prompt)[: max(0, len(prompt) - 1)]
        ns = (self.fingerprint, salt)
        with self._lock:
            path, matched = self._walk(ns, key)
            if matched <= longer_than:
                self._counts["misses"] += 1
                return PrefixLease(self, (), [])
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += matched - max(0, longer_than)
            tick = next(self._clock)
            chunks = []
            for node, taken in path:
                assert node.kv is not None
                node.last_used = tick
                chunks.append(node.kv if taken == len(node.edge) else node.kv.prefix(taken))
            lease = PrefixLease(self, key[:matched], chunks)
            lease._nodes = [node for node, _ in path]
            for node in lease._nodes:
                node.leases.add(lease)
            return lease

    def lookup(self, prompt: Sequence[int], *, longer_than: int = 0, salt: str = "") -> KVSnapshot | None:
        """KV of the longest cached prefix of ``prompt`` longer than ``longer_than`` (and shorter
        than ``prompt``), or None. ``hit.tokens == tuple(prompt[:hit.num_tokens])``."""
        with self.acquire(prompt, longer_than=longer_than, salt=salt) as lease:
            return lease.snapshot() if lease.num_tokens else None

    def match_len(self, tokens: Sequence[int], *, salt: str = "") -> int:
        """How many leading tokens of ``tokens`` are cached (read-only: no stats, no LRU touch)."""
        with self._lock:
            return self._walk((self.fingerprint, salt), tuple(int(t) for t in tokens))[1]

    def _walk(self, ns: Namespace, key: tuple[int, ...]) -> tuple[list[tuple[PrefixNode, int]], int]:
        """Nodes along the longest cached prefix of ``key`` with the tokens taken from each."""
        node = self._roots.get(ns)
        path: list[tuple[PrefixNode, int]] = []
        i = 0
        while node is not None and i < len(key):
            child = node.children.get(key[i])
            if child is None:
                break
            taken = common_prefix_len(child.edge, key[i : i + len(child.edge)])
            path.append((child, taken))
            i += taken
            node = child if taken == len(child.edge) else None
        return path, i

    # ---- eviction --------------------------------------------------------------------
    def _make_room(self, need: int, protect: set[int]) -> bool:
        """Evict leaves until ``need`` more bytes fit the budget; False if they cannot."""
        if self.budget_bytes is None:
            return True
        while self._bytes + need > self.budget_bytes:
            leaves = [n for n in self._nodes() if not n.children and not n.leases and id(n) not in protect]
            if not leaves:
                return False
            self._remove(min(leaves, key=self._policy.priority))
        return True

    def _remove(self, leaf: PrefixNode) -> None:
        assert leaf.parent is not None
        del leaf.parent.children[leaf.edge[0]]
        self._bytes -= leaf.nbytes
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += leaf.nbytes

    def _nodes(self) -> list[PrefixNode]:
        """Every non-root node (depth-first)."""
        stack = [child for root in self._roots.values() for child in root.children.values()]
        found = []
        while stack:
            node = stack.pop()
            found.append(node)
            stack.extend(node.children.values())
        return found

    def _release(self, lease: PrefixLease) -> None:
        with self._lock:
            for node in lease._nodes:
                node.leases.discard(lease)
            lease._nodes = []

    def stats(self) -> PrefixCacheStats:
        """A consistent copy of the counters."""
        with self._lock:
            return PrefixCacheStats(bytes=self._bytes, budget_bytes=self.budget_bytes,
                                    nodes=len(self._nodes()), **self._counts)


def _path_cuts(path: list[tuple[PrefixNode, int]]) -> Cuts:
    """The cuts of the KV the nodes along ``path`` hold (the tokens taken from each), from the root."""
    parts = []
    for node, taken in path:
        assert node.kv is not None
        parts.append((prefix_cuts(node.kv.cuts, taken), taken))
    return join_cuts(parts)
