"""SlotEngine: what every engine over KV slots shares, whatever computes the KV.

A slot engine owns a ``SlotPool`` of ``KVSlot`` backends (OpenVINO stateful requests, paged
block tables, or the fake slots of ``agentkv.testing``), the registry of shared prefixes and
the prefix cache, how snapshots are made and whether restores are exact, the metrics of a
call, the RoPE convention (measured once, by the subclass) and the bookkeeping of open
sessions. Its sessions are ``SlotSession``s: the alignment, fork, drop, offload and restore
code is the same for every backend. Subclasses load a model (or a fake) and call
``super().__init__``::

    class MyEngine(SlotEngine):
        def __init__(self):
            super().__init__(slots=[...], tokenizer=tok, fingerprint="my-model:kv=f16",
                             eos_token_ids={2}, max_context_len=4096, kv_bytes_per_token=1024)

        def _rope_reference(self):   # θ from the model's metadata, and the fit's tolerance floor
            return (100_000.0, 1.0), 1e-2
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, TypeVar

import anyio
import numpy as np

from agentkv.engine.base import Alignment, GenerationMetrics, Tokenizer
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.engine.prefix.radix import PrefixCache, PrefixCacheStats
from agentkv.kv.rope import FIT_TOLERANCE, PROBE_TEXT, RopeConvention, measure_convention
from agentkv.engine.session.session import SlotSession
from agentkv.engine.session.slot_pool import OffloadedKV, HostKVStore, SlotPool
from agentkv.kv.snapshot import KVSnapshot, PrecisionChoice
from agentkv.errors import AgentKVError

T = TypeVar("T")
logger = logging.getLogger(__name__)

MIN_PREFIX_HIT_TOKENS = 16
"""A prefix-cache hit is used only when it saves at least this many tokens of prefill."""


class PrefixStore(Protocol):
    """What a slot engine asks of its prefix cache (``PrefixCache`` copies KV to the host; the
    paged engine's ``PagedPrefixCache`` shares blocks)."""

    def match_len(self, tokens: Sequence[int], *, salt: str = "") -> int: ...
    def lookup(self, prompt: Sequence[int], *, longer_than: int = 0, salt: str = "") -> KVSource | None: ...
    async def capture(self, session: Any, slot: Any, *, salt: str = "") -> int: ...
    def stats(self) -> PrefixCacheStats: ...


class SlotEngine:
    """Pool, prefixes, snapshots, metrics and sessions of an engine over KV slots (no model here)."""

    session_class: type[SlotSession] = SlotSession

    def __init__(
        self,
        *,
        slots: Sequence[KVSlot],
        tokenizer: Any,
        fingerprint: str,
        eos_token_ids: Iterable[int],
        max_context_len: int,
        kv_bytes_per_token: int,
        restores_exact: bool = True,
        prefill_chunk_size: int | None = None,
        snapshot_precision: PrecisionChoice = "auto",
        prefix_cache_bytes: int | None = 0,
        prefix_cache_precision: PrecisionChoice = "auto",
        offload_bytes: int | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``restores_exact``: the slots give back written KV bit for bit (not a u8 stateful
        cache). ``prefix_cache_bytes`` 0 disables the prefix cache; ``offload_bytes`` bounds
        the host memory of offloaded idle sessions (``spill_dir``: where the excess goes)."""
        self._tokenizer = tokenizer
        self._fingerprint = fingerprint
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._max_context_len = max_context_len
        self._kv_token_bytes = kv_bytes_per_token
        self._restores_exact = restores_exact
        self.prefill_chunk_size = prefill_chunk_size
        self.snapshot_precision: PrecisionChoice = snapshot_precision
        self.pool = SlotPool(list(slots), host=HostKVStore(offload_bytes, spill_dir))
        """The slots sessions are bound to, and the host store of offloaded KV."""
        self.boundaries = PrefixBoundaries()
        """Registered prefixes: chunk boundaries of every prefill, cached or not (canonical chunking)."""
        self.prefix_cache: PrefixStore | None = (
            None if prefix_cache_bytes == 0 else self._make_prefix_cache(prefix_cache_bytes, prefix_cache_precision))
        """Shared prefixes' KV (None: off); ``engine.prefix_cache.stats()``."""
        self._sessions: set[SlotSession] = set()
        self._rope: RopeConvention | None = None
        self._rope_measured = False
        self._rope_lock = anyio.Lock()

    def _make_prefix_cache(self, budget_bytes: int | None, precision: PrecisionChoice) -> PrefixStore:
        """The prefix cache: host copies of cached KV in ``precision`` (the paged engine shares blocks)."""
        return PrefixCache(fingerprint=self._fingerprint, budget_bytes=budget_bytes, precision=precision,
                           limiter=self.pool.limiter, boundaries=self.boundaries)

    # ---- Engine protocol ---------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer  # type: ignore[no-any-return]

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def max_context_len(self) -> int:
        return self._max_context_len

    async def open_session(self, *, salt: str = "") -> SlotSession:
        """A new empty session (bound to a slot when it first runs). ``salt`` names its tenant:
        it shares cached prefixes only with sessions of the same salt."""
        return self.new_session(salt=salt)

    def register_prefix(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Mark ``tokens`` as a shared prefix of tenant ``salt``: a chunk boundary of every
        prefill that covers it, and cached once a session of that tenant has read it (when the
        prefix cache is enabled)."""
        self.boundaries.register(tokens, salt=salt)

    async def rope_convention(self) -> RopeConvention | None:
        """The model's RoPE, measured once (``_measure_rope``); None if no rotation explains the
        keys (span drops are then unavailable). Must not be called while holding a slot lease."""
        async with self._rope_lock:
            if not self._rope_measured:
                self._rope = await self._measure_rope()
                self._rope_measured = True
        return self._rope

    async def _measure_rope(self) -> RopeConvention | None:
        """The model's RoPE measured on a temporary session's slot (``engine/rope.py``): θ from
        ``_rope_reference`` verified on the keys (fitted when there is none); None, with a
        warning, when no rotation explains them."""
        metadata, floor = self._rope_reference()
        ids = self.tokenizer.encode(PROBE_TEXT)
        probe = self.new_session()
        try:
            async with self.pool.lease(probe) as slot:
                return await self.run_blocking(
                    lambda: measure_convention(slot, ids, floor=floor, metadata=metadata))
        except AgentKVError as error:
            logger.warning("cannot measure the model's RoPE convention: %s", error)
            return None
        finally:
            await probe.close()

    def _rope_reference(self) -> tuple[tuple[float, float] | None, float]:
        """(θ and linear scale from the model's metadata, or None to fit them; the tolerance
        floor of the fit). Subclasses that know their model say so; this one fits, f32 floor."""
        return None, FIT_TOLERANCE["f32"]

    async def aclose(self) -> None:
        """Close every open session."""
        for session in list(self._sessions):
            await session.close()

    # ---- helpers used by sessions ------------------------------------------------------
    def new_session(self, **state: Any) -> SlotSession:
        """Synchronous constructor used by ``open_session`` and ``fork`` (``state``: what a
        forked session starts with, passed to ``session_class``)."""
        session = self.session_class(self, **state)
        self._sessions.add(session)
        return session

    def forget(self, session: SlotSession) -> None:
        """Called by ``session.close()``."""
        self._sessions.discard(session)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking slot step in a worker thread (at most one per slot at a time).

        NOTE: not abandoned on cancellation: the step finishes and updates the log with the KV,
        then the cancellation is delivered. That keeps the invariant under cancel."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.pool.limiter)

    def new_log(self) -> KVLog:
        """An empty token log that cuts its prefills canonically for this engine."""
        return KVLog(boundaries=self.boundaries, chunk_size=self.prefill_chunk_size)

    def make_snapshot(self, log: KVLog, slot: KVSlot) -> KVSnapshot:
        """Host snapshot of ``log``'s KV, read from ``slot``, in this engine's snapshot precision
        ("auto": lossless); an inexact log's snapshot says so (blocking)."""
        keys, values = log.read(slot)
        return self.snapshot_of(log.tokens, keys, values, shifted=log.shifted, lossless=log.exact)

    def snapshot_of(self, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, *, shifted: bool,
                    lossless: bool) -> KVSnapshot:
        """Host snapshot of ``tokens``' float32 KV in this engine's snapshot precision."""
        return KVSnapshot.from_float(tuple(tokens), keys, values, precision=self.snapshot_precision,
                                     fingerprint=self._fingerprint, shifted=shifted, lossless=lossless)

    def hold_copy(self, log: KVLog, slot: KVSlot) -> OffloadedKV:
        """What a fork holds of ``log``'s KV until it gets a slot: a host snapshot (blocking;
        the paged engine shares blocks instead)."""
        return self.pool.host.put(self.make_snapshot(log, slot))

    def restores_exactly(self, snapshot: KVSource) -> bool:
        """True when writing ``snapshot`` into a slot gives the KV it was read from, bit for bit."""
        return snapshot.lossless and self._restores_exact

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the cache (all layers)."""
        return self._kv_token_bytes

    def metrics_for(
        self, log: KVLog, align: Alignment, *, generated: int, ttft: float, tpot: float
    ) -> GenerationMetrics:
        """Metrics of one call from its alignment and the log it left."""
        return align.metrics(generated=generated, ttft=ttft, tpot=tpot, kv_tokens=len(log),
                             kv_bytes=len(log) * self._kv_token_bytes, kv_exact=log.exact)

    def prefix_cache_lookup(self, prompt: Sequence[int], reused: int, *, salt: str = "") -> KVSource | None:
        """The longest cached *registered* prefix of ``prompt`` that adds at least
        ``MIN_PREFIX_HIT_TOKENS`` to the ``reused`` tokens the session holds and leaves one
        token to prefill.

        NOTE: whole registered prefixes only: they are chunk boundaries of a cold prefill too,
        so a hit computes exactly what a cold start would. A hit of a few tokens (a shared
        "<|im_start|>system\nYou are a") would cost a KV copy bigger than the prefill it saves."""
        if self.prefix_cache is None:
            return None
        for mark in reversed(self.boundaries.prefixes_of(prompt, salt=salt)):
            if len(mark) < len(prompt) and len(mark) >= reused + MIN_PREFIX_HIT_TOKENS:
                if self.prefix_cache.match_len(mark, salt=salt) == len(mark):
                    return self.prefix_cache.lookup(prompt[: len(mark) + 1], longer_than=len(mark) - 1, salt=salt)
        return None

    async def prefix_cache_store(self, session: SlotSession, slot: KVSlot) -> None:
        """Give the prefix cache a chance to copy registered prefixes out of ``slot``."""
        if self.prefix_cache is not None:
            await self.prefix_cache.capture(session, slot, salt=session.salt)

