"""SlotSession: one conversation's KV on an engine's slots — stateful requests, paged block
tables or the test suite's fake slots, through one code path.

Keeps the invariant of DESIGN.md — the slot's KV is exactly the KV of ``tokens`` — through
generate (align to the longest common prefix, prefill the rest, decode), trim, fork,
snapshot/restore and slot offload; the token log and every KV change live in its ``KVLog``
(``engine/kv_log.py``). Every public method takes the session's lock, then a slot lease, then
runs blocking model work through ``engine.run_blocking`` (a worker thread)::

    session = await engine.open_session()
    async for delta in session.stream(ids, GenerationConfig(max_new_tokens=32)):
        print(delta.text, end="")
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio
import numpy as np

from agentkv.engine.base import (
    Alignment,
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    TokenConstraint,
    TokenDelta,
    common_prefix_len,
)
from agentkv.engine.decode.loop import DecodeEngine, DecodeLoop, step_counts, with_steps
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.kv.rope import RopeConvention
from agentkv.engine.session.common import SessionCommon
from agentkv.engine.session.slot_pool import OffloadedKV, SlotPool
from agentkv.kv.snapshot import KVSnapshot
from agentkv.errors import (
    KVLogCorrupt,
    KVShiftUnsupported,
    SnapshotIncompatible,
    UserError,
)



class SessionEngine(DecodeEngine, Protocol):
    """What a ``SlotSession`` asks of its engine (a ``SlotEngine``)."""

    pool: SlotPool
    fingerprint: str

    def new_log(self) -> KVLog: ...
    def new_session(self, **state: Any) -> SlotSession: ...
    def forget(self, session: SlotSession) -> None: ...
    def restores_exactly(self, snapshot: KVSource) -> bool: ...
    def make_snapshot(self, log: KVLog, slot: KVSlot) -> KVSnapshot: ...
    def hold_copy(self, log: KVLog, slot: KVSlot) -> OffloadedKV: ...
    def prefix_cache_lookup(self, prompt: Sequence[int], reused: int, *, salt: str = "") -> KVSource | None: ...
    async def run_blocking(self, fn: Any, *args: Any) -> Any: ...
    async def prefix_cache_store(self, session: SlotSession, slot: KVSlot) -> None: ...
    async def rope_convention(self) -> RopeConvention | None: ...


def _alignment(reused: int, cached: int, restored: int, prefilled: int, recomputed: int) -> Alignment:
    """The counts of one alignment. Tokens the session re-prefilled when it got its slot back
    (its offloaded KV had been dropped) count as prefilled, not reused: nothing was reused."""
    recomputed = min(recomputed, reused)
    return Alignment(reused=reused - recomputed, prefix_cache=cached, restored=min(restored, reused),
                     prefilled=prefilled + recomputed)


class SlotSession(SessionCommon):
    """A KV session bound (lazily) to a slot of a ``SlotEngine`` (stateful, paged or fake)."""

    def __init__(
        self,
        engine: SessionEngine,
        session_id: str | None = None,
        *,
        log: KVLog | None = None,
        held: OffloadedKV | None = None,
        salt: str = "",
    ) -> None:
        """``log`` and ``held`` (its KV waiting on the host) start a session from a fork;
        ``salt``: its tenant (cached prefixes are shared within a salt only)."""
        self._engine = engine
        self.salt = salt
        self._id = session_id or uuid.uuid4().hex
        self._log = log or engine.new_log()
        self._host: OffloadedKV | None = held  # KV waiting to be put into a slot
        self._closed = False
        # NOTE: a semaphore, not a Lock: a stream abandoned mid-way is closed by the async-generator
        # finalizer in another task, and a Lock refuses release from a task that did not take it.
        self._lock = anyio.Semaphore(1)
        self.restored_tokens_pending = 0
        self.recomputed_tokens_pending = 0  # log re-prefilled on adopt (its host KV was dropped)

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._log.tokens)

    @property
    def shifted(self) -> bool:
        return self._log.shifted

    @property
    def kv_exact(self) -> bool:
        """False once part of the KV came back from a lossy restore (a u8 cache through the
        state API, or a snapshot stored in a rounding precision): close to, not equal to, what
        the model computed. A trim to 0 makes it exact again."""
        return self._log.exact

    # ---- slot pool callbacks (run in worker threads, under the pool's lease) ---------
    def offload(self, slot: KVSlot) -> None:
        """Copy this session's KV to host memory before its slot is given away."""
        self._host = self._engine.pool.host.put(self._engine.make_snapshot(self._log, slot))
        slot.reset()

    @property
    def held_kv(self) -> OffloadedKV | None:
        """The KV this session holds while it has no slot (None when bound or empty)."""
        return self._host

    async def spill_held_blocks(self) -> bool:
        """If this session is idle, has no slot and holds its KV as references on pool blocks
        (a fork that has not run yet), move that KV to the host store and let the blocks go;
        True if it did. Skipped while the session runs a call of its own (it may be reading
        those blocks); the copy runs in a worker thread."""
        held = self._host
        if held is None or not getattr(held, "in_pool", False) or self._engine.pool.is_bound(self):
            return False
        try:
            self._lock.acquire_nowait()
        except anyio.WouldBlock:
            return False
        try:
            # NOTE: the default thread limiter: the caller is an allocation holding one of the pool's
            snapshot = await anyio.to_thread.run_sync(held.load)
            if snapshot is None or self._host is not held:
                return False
            self._host = await anyio.to_thread.run_sync(self._engine.pool.host.put, snapshot)
            held.release()
            return True
        finally:
            self._lock.release()

    def adopt(self, slot: KVSlot) -> None:
        """Fill a newly bound slot with this session's KV (empty if it has none on the host).
        On any failure the slot is emptied and so is the log: never partial KV."""
        try:
            self._adopt(slot)
        except BaseException:
            self._log.clear(slot)
            raise

    def _adopt(self, slot: KVSlot) -> None:
        slot.reset()
        host, self._host = self._host, None
        snapshot = None if host is None else host.take()  # None: empty, or dropped by the host budget
        if snapshot is None or snapshot.num_tokens == 0:
            if self._log.tokens:  # NOTE: its KV was dropped: re-prefill the log (exact again, unshifted)
                tokens = list(self._log.tokens)
                self._log.forget()
                self._log.feed(slot, tokens)
                self.recomputed_tokens_pending += len(tokens)
            return
        try:
            self._log.load(slot, snapshot, exact=self._engine.restores_exactly(snapshot))
        finally:
            snapshot.release()  # what the slot did not take
        self.restored_tokens_pending += snapshot.num_tokens

    # ---- generation ------------------------------------------------------------------
    async def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        async with self._lock:
            self._ensure_open()
            async with self._engine.pool.lease(self) as slot:
                started, before = time.perf_counter(), step_counts(slot)
                align = await self._align(slot, prompt)
                loop = DecodeLoop(self._engine, self._log, slot, self._run, prompt, config, constraint, align, started,
                                  steps_before=before)
                async for event in loop.run():
                    yield event

    async def prefill(self, prompt_tokens: Sequence[int]) -> GenerationMetrics:
        """Align to ``prompt_tokens`` without generating."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, GenerationConfig(max_new_tokens=0))
        async with self._lock:
            self._ensure_open()
            async with self._engine.pool.lease(self) as slot:
                started, before = time.perf_counter(), step_counts(slot)
                align = await self._align(slot, prompt)
                elapsed = time.perf_counter() - started
                return with_steps(self._engine.metrics_for(self._log, align, generated=0, ttft=elapsed, tpot=0.0),
                                  slot, before)

    async def _align(self, slot: KVSlot, prompt: list[int]) -> Alignment:
        """Trim the KV to the longest common prefix with ``prompt``, prefill the rest.

        Returns counts for the metrics. Leaves the log's last logits = logits after ``prompt[-1]``.
        """
        log = self._log
        restored, self.restored_tokens_pending = self.restored_tokens_pending, 0
        recomputed, self.recomputed_tokens_pending = self.recomputed_tokens_pending, 0
        reused = common_prefix_len(log.tokens, prompt)
        if reused == len(prompt) and reused == len(log) and log.last_logits is not None:
            return _alignment(reused, 0, restored, 0, recomputed)
        # NOTE: a prompt fully covered by the KV still needs its last token fed to get logits.
        reused = min(reused, len(prompt) - 1)
        cached = 0
        if reused < len(log):
            await self._run(log.trim, slot, reused)
        hit = self._engine.prefix_cache_lookup(prompt, reused, salt=self.salt)
        if hit is not None:
            try:
                await self._run(self._load_blocking, slot, hit)
            finally:
                hit.release()  # what the slot did not take (a paged hit's block references)
            cached = hit.num_tokens - reused
            reused_from_cache = hit.num_tokens
        else:
            reused_from_cache = reused
        await self._run(log.feed, slot, prompt[reused_from_cache:])
        await self._engine.prefix_cache_store(self, slot)
        return _alignment(reused, cached, restored, len(prompt) - reused_from_cache, recomputed)

    # ---- blocking steps (worker threads; the caller holds lock + lease) --------------
    async def _run(self, fn, *args):  # type: ignore[no-untyped-def]
        return await self._engine.run_blocking(fn, *args)

    def _load_blocking(self, slot: KVSlot, source: KVSource) -> None:
        self._log.load(slot, source, exact=self._engine.restores_exactly(source))

    # ---- other operations ------------------------------------------------------------
    async def next_token_logits(self) -> np.ndarray:
        """float32 logits ``[vocab]`` for the token after ``tokens``."""
        async with self._lock:
            self._ensure_open()
            log = self._log
            if not log.tokens:
                raise UserError("the session is empty: prefill or generate before asking for logits")
            async with self._engine.pool.lease(self) as slot:
                self.restored_tokens_pending = self.recomputed_tokens_pending = 0
                if log.last_logits is None:
                    last = log.tokens[-1]
                    await self._run(log.trim, slot, len(log) - 1)
                    await self._run(log.feed, slot, [last])
                assert log.last_logits is not None
                return log.last_logits.copy()

    async def trim(self, n: int) -> None:
        """Keep the first ``n`` tokens and their KV."""
        if n < 0:
            raise UserError(f"trim(n) needs n >= 0, got {n}")
        async with self._lock:
            self._ensure_open()
            if n >= len(self._log):
                return
            async with self._engine.pool.lease(self) as slot:
                await self._run(self._log.trim, slot, n)

    async def snapshot(self) -> KVSnapshot:
        """A host copy of KV and tokens."""
        async with self._lock:
            self._ensure_open()
            return await self._snapshot_locked()

    async def _host_snapshot(self) -> KVSnapshot | None:
        """The offloaded KV as a snapshot while the session has no slot; None when it is bound,
        holds nothing offloaded, or its host KV was dropped (a lease then re-prefills it)."""
        if self._engine.pool.is_bound(self) or self._host is None:
            return None
        return await self._run(self._host.load)

    async def _snapshot_locked(self) -> KVSnapshot:
        held = await self._host_snapshot()
        if held is not None:
            return held
        async with self._engine.pool.lease(self) as slot:
            return await self._run(self._engine.make_snapshot, self._log, slot)

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
            self._log.forget()
            self.restored_tokens_pending = self.recomputed_tokens_pending = 0
            async with self._engine.pool.lease(self) as slot:
                await self._run(self._load_blocking, slot, snapshot)
                self.restored_tokens_pending = snapshot.num_tokens

    async def fork(self) -> SlotSession:
        """A new session holding this KV (a host copy, or on the paged engine the same blocks,
        copied on write); it is put into a slot when it first runs."""
        async with self._lock:
            self._ensure_open()
            snapshot = await self._host_snapshot()
            if snapshot is not None:
                held = await self._run(self._engine.pool.host.put, snapshot)
            else:
                async with self._engine.pool.lease(self) as slot:
                    held = await self._run(self._engine.hold_copy, self._log, slot)
            log = self._engine.new_log()
            log.tokens, log.shifted, log.exact = list(self._log.tokens), self._log.shifted, self._log.exact
        return self._engine.new_session(log=log, held=held, salt=self.salt)

    async def check_integrity(self) -> None:
        """Raise ``KVLogCorrupt`` unless the KV (in a slot, or offloaded) holds exactly
        ``len(tokens)`` positions. Read-only; for tests and debugging."""
        async with self._lock:
            self._ensure_open()
            if self._engine.pool.is_bound(self):
                async with self._engine.pool.lease(self) as slot:
                    await self._run(self._log.check_integrity, slot)
            elif self._host is not None and self._host.num_tokens not in (0, len(self._log)):
                raise KVLogCorrupt(f"offloaded KV holds {self._host.num_tokens} positions, the log {len(self._log)}")

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
                await self._run(self._log.drop, slot, start, end, convention)

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
            self._log.forget()  # its KV is gone: the log says so
            self._engine.forget(self)
