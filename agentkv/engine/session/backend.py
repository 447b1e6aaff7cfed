"""SlotBackend: the one object a KV session works through — its engine's slots and KV handling.

A backend owns the ``SlotPool`` of ``KVSlot``s (OpenVINO stateful requests, paged block tables,
or the fake slots of ``agentkv.testing``) with its host store, how this backend's KV is
snapshotted, held by a fork and restored, the prefix cache, the model facts a decode loop reads
(tokenizer, EOS, context length, metrics), the RoPE convention (measured once) and the sessions
open on it. A session calls its backend; the backend never calls back into an engine, and the
engine (``SlotEngine``) reaches sessions only through its backend::

    backend = SlotBackend(slots=[...], tokenizer=tok, fingerprint="my-model:kv=f16",
                          eos_token_ids={2}, max_context_len=4096, kv_bytes_per_token=1024)
    session = SlotSession(backend)                  # joins backend.sessions
    await session.prefill(tok.encode("Hello"))

A backend whose slots share storage (the paged engine's blocks) subclasses it and overrides
``snapshot``, ``hold``, ``restores_exactly``, ``make_room`` and ``room``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio
import numpy as np

from agentkv.engine.base import Tokenizer
from agentkv.engine.generation import GenerationMetrics
from agentkv.engine.decode.alignment import Alignment
from agentkv.engine.prefix.radix import PrefixCache
from agentkv.engine.prefix.stats import CapturableSession, PrefixCacheStats
from agentkv.engine.session.offload_store import OffloadStore
from agentkv.engine.session.slot_pool import OffloadedKV, SlotPool
from agentkv.errors import AgentKVError
from agentkv.kv.block_keys import BLOCK_MULTIPLE, KVNamespace
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.kv.rope import FIT_TOLERANCE, RopeConvention
from agentkv.kv.rope_metadata import RopeMetadata
from agentkv.kv.rope_probe import PROBE_TEXT, measure_convention
from agentkv.kv.snapshot import KVSnapshot, PrecisionChoice

if TYPE_CHECKING:
    from anyio.lowlevel import EventLoopToken

T = TypeVar("T")
logger = logging.getLogger(__name__)

MIN_PREFIX_HIT_TOKENS = 16
"""A prefix-cache hit is used only when it saves at least this many tokens of prefill."""

RopeReference = tuple[RopeMetadata | tuple[float, float] | None, float]
"""(The model's RoPE metadata — or just θ and linear scale — or None to fit it; the fit's tolerance floor)."""


class PrefixStore(Protocol):
    """What a backend asks of its prefix cache (``PrefixCache`` copies KV to the host; the
    paged backend's ``PagedPrefixCache`` shares blocks)."""

    def match_len(self, tokens: Sequence[int], *, salt: str = "") -> int: ...
    def lookup(self, prompt: Sequence[int], *, longer_than: int = 0, salt: str = "") -> KVSource | None: ...
    async def capture(self, session: CapturableSession, slot: KVSlot, *, salt: str = "") -> int: ...
    def stats(self) -> PrefixCacheStats: ...


class OpenSession(Protocol):
    """What a backend reads of the sessions open on it."""

    @property
    def held_kv(self) -> OffloadedKV | None:
        """The KV the session holds while it has no slot."""

    async def spill_held_blocks(self) -> bool:
        """Move KV held as pool blocks to the host store; True if it did."""

    async def close(self) -> None:
        """Release the slot and the KV."""


class ProbeOwner:
    """A slot owner with no KV of its own: the RoPE probe (its slot starts and ends empty)."""

    def offload(self, slot: KVSlot) -> None:
        slot.reset()

    def adopt(self, slot: KVSlot) -> None:
        slot.reset()


class SlotBackend:
    """Slots, KV handling, prefixes, model facts and open sessions of one engine (no model here)."""

    def __init__(
        self,
        *,
        slots: Sequence[KVSlot],
        tokenizer: Tokenizer,
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
        rope_reference: Callable[[], RopeReference] | None = None,
    ) -> None:
        """``restores_exact``: the slots give back written KV bit for bit (not a u8 stateful
        cache). ``prefix_cache_bytes`` 0 disables the prefix cache; ``offload_bytes`` bounds
        the host memory of offloaded idle sessions (``spill_dir``: where the excess goes).
        ``rope_reference`` reads θ from the model's metadata (default: fit it, f32 floor)."""
        self.tokenizer = tokenizer
        self.fingerprint = fingerprint
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_context_len = max_context_len
        self.kv_bytes_per_token = kv_bytes_per_token
        """Bytes one token's K and V take in the cache (all layers)."""
        self._restores_exact = restores_exact
        self.prefill_chunk_size = prefill_chunk_size
        self.snapshot_precision: PrecisionChoice = snapshot_precision
        host = OffloadStore(offload_bytes, spill_dir, namespace_for=self._offload_namespace)
        self.pool = SlotPool(list(slots), host=host, lease_ended=self.lease_ended)
        """The slots sessions are bound to, and the host store of offloaded KV."""
        self.boundaries = PrefixBoundaries()
        """Registered prefixes: chunk boundaries of every prefill, cached or not (canonical chunking)."""
        self.prefix_cache: PrefixStore | None = (
            None if prefix_cache_bytes == 0 else self._make_prefix_cache(prefix_cache_bytes, prefix_cache_precision))
        """Shared prefixes' KV (None: off); ``prefix_cache.stats()``."""
        self.prefix_hit_tokens = 0
        """Prompt tokens prefix-cache hits supplied beyond what the sessions held (prefill skipped)."""
        self.sessions: set[OpenSession] = set()
        """The sessions open on this backend (a session adds itself when made, leaves on close)."""
        self._rope_reference = rope_reference or (lambda: (None, FIT_TOLERANCE["f32"]))
        self._rope: RopeConvention | None = None
        self._rope_measured = False
        self._rope_lock = anyio.Lock()

    def _offload_namespace(self, *, salt: str = "", block_size: int = BLOCK_MULTIPLE) -> KVNamespace:
        """Keys for offloaded KV until the engine gives its own ``kv_namespace`` (a backend used
        alone, in tests): the fingerprint names model, KV precision and layout."""
        return KVNamespace(salt=salt, fingerprint=self.fingerprint, layout="backend", precision="as fingerprinted",
                           numerics="as fingerprinted", chunk_size=self.prefill_chunk_size, block_size=block_size)

    def _make_prefix_cache(self, budget_bytes: int | None, precision: PrecisionChoice) -> PrefixStore:
        """The prefix cache: host copies of cached KV in ``precision`` (the paged backend shares blocks)."""
        return PrefixCache(fingerprint=self.fingerprint, budget_bytes=budget_bytes, precision=precision,
                           limiter=self.pool.limiter, boundaries=self.boundaries)

    # ---- sessions --------------------------------------------------------------------
    async def close_sessions(self) -> None:
        """Close every open session: ``await backend.close_sessions()``."""
        for session in list(self.sessions):
            await session.close()

    # ---- blocking work -----------------------------------------------------------------
    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """Run one blocking slot step in a worker thread (at most one per slot at a time)::

            logits = await backend.run_blocking(log.feed, slot, ids)

        NOTE: not abandoned on cancellation: the step finishes and updates the log with the KV,
        then the cancellation is delivered. That keeps the invariant under cancel."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.pool.limiter)

    async def make_room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1) -> None:
        """Free what ``slot`` (None: a slot about to be filled) needs to take ``tokens`` more
        positions on ``rows`` rows, before the blocking step that takes them runs:
        ``await backend.make_room(slot, len(ids))``. Slots that own their storage need nothing
        (this one); the paged backend evicts cached prefixes and offloads idle sessions, and
        sets the room aside for ``slot`` until its step takes it or the slot is emptied."""

    @asynccontextmanager
    async def room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1, rewrite: bool = False
                   ) -> AsyncIterator[None]:
        """Room for the one blocking step run inside (``rewrite``: a step replacing the KV by
        ``tokens`` positions), what it did not take given back after it, even if the call is
        cancelled before it starts. Slots that own their storage need none (this one)::

            async with backend.room(slot, len(ids)):
                await backend.run_blocking(log.feed, slot, ids)
        """
        yield

    def lease_ended(self, slot: KVSlot) -> None:
        """A lease on ``slot`` ended (a session's call, a probe): the paged backend's step
        batcher stops waiting for that slot's next feed. Nothing to do for slots that own their
        storage (this one): ``backend.lease_ended(slot)``."""

    decodes_in_thread = True
    """A call's token loop runs in one worker thread (``decode/threaded.py``) rather than one
    ``await`` per model step (the scripted engine's instant fake steps run inline instead)."""

    @contextmanager
    def room_blocking(self, slot: KVSlot | None, tokens: int, *, token: EventLoopToken,
                      before_wait: Callable[[], None] | None = None) -> Iterator[None]:
        """``room`` for a step a worker thread runs (``token``: the event loop to make room on
        when blocks must be freed first, ``before_wait()`` called before the thread waits for it).
        Slots that own their storage need none (this one)::

            with backend.room_blocking(slot, len(ids), token=loop_token):
                log.feed(slot, ids)
        """
        yield

    # ---- KV: logs, snapshots, holds ----------------------------------------------------
    def new_log(self) -> KVLog:
        """An empty token log that cuts its prefills canonically for this backend."""
        return KVLog(boundaries=self.boundaries, chunk_size=self.prefill_chunk_size)

    def snapshot(self, log: KVLog, slot: KVSlot, start: int = 0) -> KVSnapshot:
        """Host snapshot of ``log``'s KV, read from ``slot``, in the snapshot precision
        ("auto": lossless); an inexact log's snapshot says so; ``start``: of the tokens from there
        on only, a span (here read whole and cut; the paged backend reads only those) (blocking)::

            snapshot = backend.snapshot(log, slot)
        """
        keys, values = log.read(slot)
        whole = self.snapshot_of(log.tokens, keys, values, shifted=log.shifted, lossless=log.exact, cuts=log.cuts)
        return whole.span(start, whole.num_tokens) if start else whole

    def snapshot_of(self, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, *, shifted: bool,
                    lossless: bool, cuts: Sequence[int] | None) -> KVSnapshot:
        """Host snapshot of ``tokens``' float32 KV in the snapshot precision, computed by passes
        beginning at ``cuts`` (None: unknown):
        ``backend.snapshot_of(tokens, keys, values, shifted=False, lossless=True, cuts=log.cuts)``."""
        return KVSnapshot.from_float(tuple(tokens), keys, values, precision=self.snapshot_precision,
                                     fingerprint=self.fingerprint, shifted=shifted, lossless=lossless, cuts=cuts)

    def hold(self, log: KVLog, slot: KVSlot, *, salt: str = "") -> OffloadedKV:
        """What a fork holds of ``log``'s KV until it gets a slot: its blocks in the offload store
        (blocking; the paged backend shares pool blocks instead): ``held = backend.hold(log, slot)``."""
        return self.pool.host.put(self.snapshot(log, slot), salt=salt)

    def restores_exactly(self, source: KVSource) -> bool:
        """True when writing ``source`` into a slot gives the KV it was read from, bit for bit:
        ``backend.restores_exactly(snapshot)``."""
        return source.lossless and self._restores_exact

    def metrics_for(
        self, log: KVLog, align: Alignment, *, generated: int, ttft: float, tpot: float
    ) -> GenerationMetrics:
        """Metrics of one call from its alignment and the log it left:
        ``backend.metrics_for(log, align, generated=8, ttft=0.1, tpot=0.01)``."""
        return align.metrics(generated=generated, ttft=ttft, tpot=tpot, kv_tokens=len(log),
                             kv_bytes=len(log) * self.kv_bytes_per_token, kv_exact=log.exact)

    # ---- prefixes --------------------------------------------------------------------
    def prefix_hit(self, prompt: Sequence[int], reused: int, *, salt: str = "") -> KVSource | None:
        """The longest cached *registered* prefix of ``prompt`` that adds at least
        ``MIN_PREFIX_HIT_TOKENS`` to the ``reused`` tokens the session holds and leaves one
        token to prefill: ``hit = backend.prefix_hit(prompt, reused, salt=session.salt)``.

        NOTE: whole registered prefixes only: they are chunk boundaries of a cold prefill too,
        so a hit computes exactly what a cold start would. A hit of a few tokens (a shared
        "<|im_start|>system\nYou are a") would cost a KV copy bigger than the prefill it saves."""
        if self.prefix_cache is None:
            return None
        for mark in reversed(self.boundaries.prefixes_of(prompt, salt=salt)):
            if len(mark) < len(prompt) and len(mark) >= reused + MIN_PREFIX_HIT_TOKENS:
                if self.prefix_cache.match_len(mark, salt=salt) == len(mark):
                    hit = self.prefix_cache.lookup(prompt[: len(mark) + 1], longer_than=len(mark) - 1, salt=salt)
                    if hit is not None:
                        self.prefix_hit_tokens += hit.num_tokens - reused
                    return hit
        return None

    async def cached_prefix(self, prompt: Sequence[int], reused: int, *, salt: str = "") -> KVSource | None:
        """What gives the session more of ``prompt`` than the ``reused`` tokens it holds: a cached
        registered prefix (``prefix_hit``), or a longer run of full blocks the offload store holds
        as a cold prefill computes them (another session's system prompt and first message, saved
        or offloaded), whichever covers more; with the prefix cache on only:
        ``hit = await backend.cached_prefix(prompt, reused, salt=session.salt)``."""
        hit = self.prefix_hit(prompt, reused, salt=salt)
        held = reused if hit is None else hit.num_tokens
        better_than = held + MIN_PREFIX_HIT_TOKENS - 1
        # NOTE: a turn that continues its session (nearly always) has no block to gain: no thread hop
        if self.prefix_cache is None or self.pool.host.prefix_room(len(prompt)) <= better_than:
            return hit
        cuts = [len(mark) for mark in self.boundaries.prefixes_of(prompt, salt=salt)]
        stored = await self.run_blocking(partial(self.pool.host.find_prefix, prompt, salt=salt, cuts=cuts,
                                                 better_than=better_than))
        if stored is None:
            return hit
        if hit is not None:
            hit.release()
        self.prefix_hit_tokens += stored.num_tokens - held
        return stored

    async def capture_prefixes(self, session: CapturableSession, slot: KVSlot, *, salt: str = "") -> None:
        """Let the prefix cache take the registered prefixes ``session`` now holds in ``slot``
        (the caller holds the lease): ``await backend.capture_prefixes(session, slot, salt=salt)``."""
        if self.prefix_cache is not None:
            await self.prefix_cache.capture(session, slot, salt=salt)

    # ---- RoPE ------------------------------------------------------------------------
    async def rope_convention(self) -> RopeConvention | None:
        """The model's RoPE, measured once: ``convention = await backend.rope_convention()``;
        None if no rotation explains the keys (span drops are then unavailable). Must not be
        called while holding a slot lease."""
        async with self._rope_lock:
            if not self._rope_measured:
                self._rope = await self._measure_rope()
                self._rope_measured = True
        return self._rope

    async def _measure_rope(self) -> RopeConvention | None:
        """The model's RoPE measured on a temporary session's slot (``kv/rope.py``): θ from the
        model's metadata verified on the keys (fitted when there is none); None, with a
        warning, when no rotation explains them."""
        metadata, floor = self._rope_reference()
        ids = self.tokenizer.encode(PROBE_TEXT)
        probe = ProbeOwner()
        async def make_room(slot: KVSlot) -> None:
            await self.make_room(slot, 2 * len(ids))

        try:
            async with self.pool.lease(probe, prepare=make_room) as slot:
                return await self.run_blocking(
                    lambda: measure_convention(slot, ids, floor=floor, metadata=metadata))
        except AgentKVError as error:
            logger.warning("cannot measure the model's RoPE convention: %s", error)
            return None
        finally:
            await self.pool.release(probe)
