"""StatefulSession: one conversation's KV on the OpenVINO stateful engine.

Keeps the invariant of DESIGN.md — the slot's KV is exactly the KV of ``tokens`` — through
generate (align to the longest common prefix, prefill the rest, decode), trim, fork,
snapshot/restore and slot offload. Every public method takes the session's lock, then a
slot lease, then runs blocking model work in a worker thread::

    session = await engine.open_session()
    async for delta in session.stream(ids, GenerationConfig(max_new_tokens=32)):
        print(delta.text, end="")
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import TYPE_CHECKING

import anyio
import numpy as np

from agentkv.engine.base import (
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
    common_prefix_len,
)
from agentkv.engine.chunking import chunk_spans
from agentkv.engine.decode import DecodeLoop
from agentkv.engine.rope import RopeConvention, drop_span
from agentkv.engine.session_common import SessionCommon
from agentkv.engine.slot import Slot
from agentkv.engine.slots import HostKV
from agentkv.engine.snapshot import KVSnapshot
from agentkv.errors import (
    KVShiftUnsupported,
    SnapshotIncompatible,
    UserError,
)

if TYPE_CHECKING:
    from agentkv.engine.stateful import StatefulEngine


def _align_counts(reused: int, cached: int, restored: int, prefilled: int, recomputed: int) -> dict[str, int]:
    """Metric counts of one alignment. Tokens the session re-prefilled when it got its slot back
    (its offloaded KV had been dropped) count as prefilled, not reused: nothing was reused."""
    recomputed = min(recomputed, reused)
    return {
        "reused": reused - recomputed,
        "prefix_cache": cached,
        "restored": min(restored, reused),
        "prefilled": prefilled + recomputed,
    }


class StatefulSession(SessionCommon):
    """A KV session bound (lazily) to a slot of a ``StatefulEngine``."""

    def __init__(self, engine: StatefulEngine, session_id: str | None = None) -> None:
        self._engine = engine
        self._id = session_id or uuid.uuid4().hex
        self._tokens: list[int] = []
        self._last_logits: np.ndarray | None = None  # logits after tokens[-1], if known
        self._host: HostKV | None = None  # KV waiting to be put into a slot
        self._shifted = False
        self._kv_exact = True  # False once KV came back from a lossy restore
        self._closed = False
        # NOTE: a semaphore, not a Lock: a stream abandoned mid-way is closed by the async-generator
        # finalizer in another task, and a Lock refuses release from a task that did not take it.
        self._lock = anyio.Semaphore(1)
        self.restored_tokens_pending = 0
        self.recomputed_tokens_pending = 0  # log re-prefilled on adopt (its host KV was dropped)
        self.last_metrics: GenerationMetrics | None = None

    # ---- slot pool callbacks (run in worker threads, under the pool's lease) ---------
    def offload(self, slot: Slot) -> None:
        """Copy this session's KV to host memory before its slot is given away."""
        keys, values = slot.read()
        self._host = self._engine.pool.host.put(
            self._engine.make_snapshot(self._tokens, keys, values, self._shifted, self._kv_exact)
        )
        slot.reset()

    def adopt(self, slot: Slot) -> None:
        """Fill a newly bound slot with this session's KV (empty if it has none on the host).
        On any failure the slot is emptied and so is the log: never partial KV."""
        try:
            self._adopt(slot)
        except BaseException:
            slot.reset()
            self._tokens, self._last_logits = [], None
            raise

    def _adopt(self, slot: Slot) -> None:
        slot.reset()
        host, self._host = self._host, None
        snapshot = None if host is None else host.take()  # None: empty, or dropped by the host budget
        if snapshot is None or snapshot.num_tokens == 0:
            if self._tokens:  # NOTE: its KV was dropped: re-prefill the log (exact again, unshifted)
                tokens, self._tokens, self._last_logits = self._tokens, [], None
                self._shifted, self._kv_exact = False, True
                self._feed_blocking(slot, tokens)
                self.recomputed_tokens_pending += len(tokens)
            return
        keys, values = snapshot.to_float()
        slot.write(keys, values)
        self._kv_exact = self._engine.restores_exactly(snapshot)
        self.restored_tokens_pending += snapshot.num_tokens

    # ---- generation ------------------------------------------------------------------
    async def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        async with self._lock:
            self._ensure_open()
            async with self._engine.pool.lease(self) as slot:
                started = time.perf_counter()
                align = await self._align(slot, prompt)
                loop = DecodeLoop(self, slot, prompt, config, constraint, align, started)
                async for event in loop.run():
                    yield event
                self.last_metrics = loop.metrics

    async def prefill(self, prompt_tokens: Sequence[int]) -> GenerationMetrics:
        """Align to ``prompt_tokens`` without generating."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, GenerationConfig(max_new_tokens=0))
        async with self._lock:
            self._ensure_open()
            async with self._engine.pool.lease(self) as slot:
                started = time.perf_counter()
                align = await self._align(slot, prompt)
                elapsed = time.perf_counter() - started
                return self._engine.metrics_for(self, align, generated=0, ttft=elapsed, tpot=0.0)

    async def _align(self, slot: Slot, prompt: list[int]) -> dict[str, int]:
        """Trim the KV to the longest common prefix with ``prompt``, prefill the rest.

        Returns counts for the metrics. Leaves ``_last_logits`` = logits after ``prompt[-1]``.
        """
        restored, self.restored_tokens_pending = self.restored_tokens_pending, 0
        recomputed, self.recomputed_tokens_pending = self.recomputed_tokens_pending, 0
        reused = common_prefix_len(self._tokens, prompt)
        if reused == len(prompt) and reused == len(self._tokens) and self._last_logits is not None:
            return _align_counts(reused, 0, restored, 0, recomputed)
        # NOTE: a prompt fully covered by the KV still needs its last token fed to get logits.
        reused = min(reused, len(prompt) - 1)
        cached = 0
        if reused < len(self._tokens):
            await self._run(self._trim_blocking, slot, reused)
        hit = self._engine.prefix_cache_lookup(prompt, reused)
        if hit is not None:
            await self._run(self._load_prefix_blocking, slot, hit)
            cached = hit.num_tokens - reused
            reused_from_cache = hit.num_tokens
        else:
            reused_from_cache = reused
        await self._run(self._feed_blocking, slot, prompt[reused_from_cache:])
        await self._engine.prefix_cache_store(self, slot)
        return _align_counts(reused, cached, restored, len(prompt) - reused_from_cache, recomputed)

    # ---- blocking steps (worker threads; the caller holds lock + lease) --------------
    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        # NOTE: not abandoned on cancellation: the step finishes and updates tokens with the
        # KV, then the cancellation is delivered. That keeps the invariant under cancel.
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._engine.pool.limiter)

    def _feed_blocking(self, slot: Slot, ids: Sequence[int]) -> np.ndarray:
        """Run ``ids`` through the model after the current tokens; they join the log. Cut at
        the canonical chunk boundaries (``engine/chunking.py``) so the same log is always
        computed the same way, whichever path reached it."""
        start = len(self._tokens)
        spans = [(start, start + len(ids))]
        if len(ids) > 1:
            engine = self._engine
            cuts = engine.boundaries.cuts_within([*self._tokens, *ids], start=start, stop=start + len(ids))
            spans = chunk_spans(start, start + len(ids), cuts=cuts, chunk_size=engine.prefill_chunk_size)
        logits = self._last_logits
        for begin, end in spans:
            piece = list(ids[begin - start : end - start])
            logits = slot.feed(np.array([piece], dtype=np.int64), past_len=begin)[0]
            self._tokens.extend(piece)
            self._last_logits = logits
        assert logits is not None
        return logits

    def _trim_blocking(self, slot: Slot, n: int) -> None:
        if n < len(self._tokens):
            slot.trim(n)
            del self._tokens[n:]
            self._last_logits = None
            if n == 0:
                self._shifted, self._kv_exact = False, True

    def _load_prefix_blocking(self, slot: Slot, snapshot: KVSnapshot) -> None:
        keys, values = snapshot.to_float()
        try:
            slot.write(keys, values)
        except BaseException:
            slot.reset()
            self._tokens, self._last_logits = [], None
            raise
        self._tokens = list(snapshot.tokens)
        self._last_logits = None
        self._kv_exact = self._engine.restores_exactly(snapshot)

    # ---- other operations ------------------------------------------------------------
    async def next_token_logits(self) -> np.ndarray:
        """float32 logits ``[vocab]`` for the token after ``tokens``."""
        async with self._lock:
            self._ensure_open()
            if not self._tokens:
                raise UserError("the session is empty: prefill or generate before asking for logits")
            async with self._engine.pool.lease(self) as slot:
                self.restored_tokens_pending = self.recomputed_tokens_pending = 0
                if self._last_logits is None:
                    last = self._tokens[-1]
                    await self._run(self._trim_blocking, slot, len(self._tokens) - 1)
                    await self._run(self._feed_blocking, slot, [last])
                assert self._last_logits is not None
                return self._last_logits.copy()

    async def trim(self, n: int) -> None:
        """Keep the first ``n`` tokens and their KV."""
        if n < 0:
            raise UserError(f"trim(n) needs n >= 0, got {n}")
        async with self._lock:
            self._ensure_open()
            if n >= len(self._tokens):
                return
            async with self._engine.pool.lease(self) as slot:
                await self._run(self._trim_blocking, slot, n)

    async def snapshot(self) -> KVSnapshot:
        """A host copy of KV and tokens."""
        async with self._lock:
            self._ensure_open()
            return await self._snapshot_locked()

    async def _snapshot_locked(self) -> KVSnapshot:
        if not self._engine.pool.is_bound(self) and self._host is not None:
            held = await self._run(self._host.load)
            if held is not None:
                return held  # else it was dropped: the lease below re-prefills it
        async with self._engine.pool.lease(self) as slot:
            keys, values = await self._run(slot.read)
            return self._engine.make_snapshot(self._tokens, keys, values, self._shifted, self._kv_exact)

    async def restore(self, snapshot: KVSnapshot) -> None:
        """Replace KV and tokens by ``snapshot``'s (fresh state or nothing)."""
        if snapshot.fingerprint != self._engine.fingerprint:
            raise SnapshotIncompatible(
                f"snapshot was made by model {snapshot.fingerprint!r}, this engine runs "
                f"{self._engine.fingerprint!r}; re-prefill the history instead"
            )
        async with self._lock:
            self._ensure_open()
            if self._host is not None:  # the old KV is being replaced: don't bring it back first
                self._host.release()
                self._host = None
            self._tokens, self._last_logits = [], None
            self.restored_tokens_pending = self.recomputed_tokens_pending = 0
            async with self._engine.pool.lease(self) as slot:
                await self._run(self._load_prefix_blocking, slot, snapshot)
                self._shifted = snapshot.shifted
                self.restored_tokens_pending = snapshot.num_tokens

    async def fork(self) -> StatefulSession:
        """A new session with a copy of this KV; the KV is put into a slot when it first runs."""
        async with self._lock:
            self._ensure_open()
            snap = await self._snapshot_locked()
        host = await self._run(self._engine.pool.host.put, snap)
        child = self._engine.new_session()
        child._tokens = list(snap.tokens)
        child._host = host
        child._shifted = snap.shifted
        child._kv_exact = self._kv_exact
        return child

    # ---- KV-level span drop (sliding window) -----------------------------------------
    @property
    def supports_drop(self) -> bool:
        """True: ``drop`` is available (it raises ``KVShiftUnsupported`` if RoPE cannot be measured)."""
        return True

    async def drop(self, start: int, end: int) -> None:
        """Remove ``tokens[start:end]`` and their KV; later keys are re-rotated by −(end−start)
        so positions stay contiguous (no re-prefill). Marks the session ``shifted``.

        ``await session.drop(32, 432)``. Raises ``KVShiftUnsupported`` (KV untouched) when the
        model's RoPE convention cannot be measured, ``UserError`` for a span outside ``tokens``.
        On a failure while writing the KV, the session is left empty, never partial.
        """
        self._check_span(start, end)
        if start == end:
            return
        convention = await self._engine.rope_convention()  # NOTE: before our lease: it needs a slot
        if convention is None:
            raise KVShiftUnsupported(
                "the model's keys fit no RoPE rotation, so a span cannot be dropped from the KV; "
                "use the Truncation policy (drop messages and re-prefill)"
            )
        async with self._lock:
            self._ensure_open()
            self._check_span(start, end)
            async with self._engine.pool.lease(self) as slot:
                await self._run(self._drop_blocking, slot, start, end, convention)

    def _drop_blocking(self, slot: Slot, start: int, end: int, convention: RopeConvention) -> None:
        keys, values = slot.read()
        keys, values = drop_span(keys, values, start, end, convention)
        try:
            slot.write(keys, values)
        except BaseException:
            slot.reset()  # never leave partial KV behind
            self._tokens, self._last_logits = [], None
            raise
        del self._tokens[start:end]
        self._last_logits = None
        self._shifted = True

    async def close(self) -> None:
        """Release the slot and the KV (idempotent)."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            await self._engine.pool.release(self)
            # NOTE: after release: an offload of this session that was under way when close()
            # began has finished by now (the pool serialises them) and may have set _host.
            if self._host is not None:
                self._host.release()
                self._host = None
            self._engine.forget(self)
