"""SlotSession: one conversation's KV on a backend's slots — stateful requests, paged block
tables or the test suite's fake slots, through one code path.

Keeps the invariant of DESIGN.md — the slot's KV is exactly the KV of ``tokens`` — through
generate (align to the longest common prefix, prefill the rest, decode), trim, fork,
snapshot/restore and slot offload; the token log and every KV change live in its ``KVLog``
(``kv/log.py``). A session holds one object, its ``SlotBackend``, and never its engine. Every
public method takes the session's lock, then a slot lease, makes room for what a step will
write (``backend.room``), then runs the blocking step in a worker thread::

    session = await engine.open_session()
    async for delta in session.stream(ids, GenerationConfig(max_new_tokens=32)):
        print(delta.text, end="")
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing, asynccontextmanager
from functools import partial
from typing import Any, TypeVar

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig, TokenConstraint, common_prefix_len
from agentkv.engine.generation import GenerationMetrics, GenerationResult, GenerationStream, TokenDelta
from agentkv.engine.decode.alignment import Alignment, validate_prompt
from agentkv.engine.decode.loop import DecodeLoop, step_counts, with_steps
from agentkv.engine.session.backend import SlotBackend
from agentkv.engine.session.slot_pool import OffloadedKV
from agentkv.errors import KVLogCorrupt, KVShiftUnsupported, KVSessionClosed, SnapshotIncompatible, UserError
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.kv.snapshot import KVSnapshot
T = TypeVar("T")


class SlotSession:
    """A KV session bound (lazily) to a slot of a ``SlotBackend`` (stateful, paged or fake)."""

    def __init__(self, backend: SlotBackend, session_id: str | None = None, *, log: KVLog | None = None,
                 held: OffloadedKV | None = None, salt: str = "") -> None:
        """A session on ``backend``, open until ``close()``: ``SlotSession(backend, salt="a")``.
        ``log`` and ``held`` (its KV waiting on the host) start a session from a fork;
        ``salt``: its tenant (cached prefixes are shared within a salt only)."""
        self._backend = backend
        self.salt = salt
        self._id = session_id or uuid.uuid4().hex
        self._log = log or backend.new_log()
        self._host: OffloadedKV | None = held  # KV waiting to be put into a slot
        self._closed = False
        # NOTE: a semaphore, not a Lock: a stream abandoned mid-way is closed by the async-generator
        # finalizer in another task, and a Lock refuses release from a task that did not take it.
        self._lock = anyio.Semaphore(1)
        self.restored_tokens_pending = 0
        self.recomputed_tokens_pending = 0  # log re-prefilled on adopt (its host KV was dropped)
        backend.sessions.add(self)

    @property
    def id(self) -> str:
        return self._id

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self._id[:8]}, tokens={len(self.tokens)})"

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._log.tokens)

    @property
    def shifted(self) -> bool:
        return self._log.shifted

    @property
    def cuts(self) -> tuple[int, ...] | None:
        """Where the passes that computed the KV began (``KVLog.cuts``); None: unknown."""
        return None if self._log.cuts is None else tuple(self._log.cuts)

    @property
    def kv_exact(self) -> bool:
        """False once part of the KV came back from a lossy restore (a u8 cache through the
        state API, or a snapshot stored in a rounding precision): close to, not equal to, what
        the model computed. A trim to 0 makes it exact again."""
        return self._log.exact

    # ---- KVSession entry points (checks now, the work when the stream is iterated) ------
    def stream(self, prompt_tokens: Sequence[int], config: GenerationConfig,
               constraint: TokenConstraint | None = None) -> GenerationStream:
        """See ``KVSession.stream``: checks happen now, the work when the stream is iterated."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, config)
        return GenerationStream(self._generate_events(prompt, config, constraint))

    async def generate(self, prompt_tokens: Sequence[int], config: GenerationConfig,
                       constraint: TokenConstraint | None = None) -> GenerationResult:
        """``stream(...)`` run to the end."""
        return await self.stream(prompt_tokens, config, constraint).collect()

    def _check_prompt(self, prompt: list[int], config: GenerationConfig) -> None:
        self._ensure_open()
        validate_prompt(prompt, config, self._backend.max_context_len)

    def _check_span(self, start: int, end: int) -> None:
        """``drop(start, end)``'s argument check (no state change)."""
        self._ensure_open()
        if not 0 <= start <= end <= len(self.tokens):
            raise UserError(
                f"drop({start}, {end}) is outside the session's {len(self.tokens)} tokens; "
                "pass 0 <= start <= end <= len(session.tokens)"
            )

    def _ensure_open(self) -> None:
        if self._closed:
            raise KVSessionClosed(f"session {self._id} is closed; open a new one with engine.open_session()")

    # ---- slot pool callbacks (run in worker threads, under the pool's lease) ---------
    def offload(self, slot: KVSlot) -> None:
        """Put this session's KV in the offload store (only blocks it lacks) before its slot goes."""
        self._host = self._backend.pool.host.put(self._backend.snapshot(self._log, slot), salt=self.salt)
        slot.reset()

    @property
    def held_kv(self) -> OffloadedKV | None:
        """The KV this session holds while it has no slot (None when bound or empty)."""
        return self._host

    async def spill_held_blocks(self) -> bool:
        """If idle, without a slot and holding its KV as references on pool blocks (a fork that has
        not run yet), move that KV to the offload store and let the blocks go: True if it did (not
        while the session runs a call of its own, which may read those blocks; in a worker thread)."""
        held = self._host
        if held is None or not getattr(held, "in_pool", False) or self._backend.pool.is_bound(self):
            return False
        try:
            self._lock.acquire_nowait()
        except anyio.WouldBlock:
            return False
        try:
            # NOTE: the default thread limiter: the caller (a backend making room) may run inside a lease
            snapshot = await anyio.to_thread.run_sync(held.load)
            if snapshot is None or self._host is not held:
                return False
            self._host = await anyio.to_thread.run_sync(partial(self._backend.pool.host.put, snapshot, salt=self.salt))
            held.release()
            return True
        finally:
            self._lock.release()

    def adopt(self, slot: KVSlot) -> None:
        """Fill a newly bound slot with this session's KV (what the offload store still holds, the
        rest re-prefilled). On any failure the slot is emptied and so is the log: never partial KV."""
        try:
            self._adopt(slot)
        except BaseException:
            self._log.clear(slot)
            raise

    def _adopt(self, slot: KVSlot) -> None:
        if slot.length():  # NOTE: a newly bound slot is empty; resetting it would drop its reserved room
            slot.reset()
        host, self._host = self._host, None
        tokens, kept = list(self._log.tokens), 0
        snapshot = None if host is None else host.take()  # all of it, a prefix (later blocks lost), or None
        if snapshot is not None and snapshot.num_tokens and list(snapshot.tokens) == tokens[:snapshot.num_tokens]:
            try:
                self._log.load(slot, snapshot, exact=self._backend.restores_exactly(snapshot))
            finally:
                snapshot.release()  # what the slot did not take
            kept = snapshot.num_tokens
            self.restored_tokens_pending += kept
        else:
            self._log.forget()  # NOTE: re-prefilled from the start: exact again, unshifted
        if kept < len(tokens):
            self._log.feed(slot, tokens[kept:])
            self.recomputed_tokens_pending += len(tokens) - kept

    # ---- generation ------------------------------------------------------------------
    async def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        async with self._lock:
            self._ensure_open()
            async with self._lease() as slot:
                started, before = time.perf_counter(), step_counts(slot)
                align = await self._align(slot, prompt)
                loop = DecodeLoop(self._backend, self._log, slot, self._run, prompt, config, constraint, align, started,
                                  steps_before=before)
                async with aclosing(loop.run()) as events:  # a draft ahead leaves the KV in this task
                    async for event in events:
                        yield event

    async def prefill(self, prompt_tokens: Sequence[int]) -> GenerationMetrics:
        """Align to ``prompt_tokens`` without generating."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, GenerationConfig(max_new_tokens=0))
        async with self._lock:
            self._ensure_open()
            async with self._lease() as slot:
                started, before = time.perf_counter(), step_counts(slot)
                align = await self._align(slot, prompt)
                elapsed = time.perf_counter() - started
                return with_steps(self._backend.metrics_for(self._log, align, generated=0, ttft=elapsed, tpot=0.0),
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
            return Alignment.counted(reused=reused, cached=0, restored=restored, prefilled=0, recomputed=recomputed)
        # NOTE: a prompt fully covered by the KV still needs its last token fed to get logits.
        reused = min(reused, len(prompt) - 1)
        cached = 0
        if reused < len(log):
            await self._run(log.trim, slot, reused)
        hit = await self._backend.cached_prefix(prompt, reused, salt=self.salt)
        if hit is not None:
            copied = 0 if getattr(hit, "in_pool", False) else hit.num_tokens  # NOTE: a copy takes blocks, a share none
            try:
                async with self._backend.room(slot, copied, rewrite=True):
                    await self._run(self._load_blocking, slot, hit)
            finally:
                hit.release()  # what the slot did not take (a paged hit's block references)
            cached = hit.num_tokens - reused
            reused_from_cache = hit.num_tokens
        else:
            reused_from_cache = reused
        fresh = prompt[reused_from_cache:]
        async with self._backend.room(slot, len(fresh)):
            await self._run(log.feed, slot, fresh)
        await self._backend.capture_prefixes(self, slot, salt=self.salt)
        return Alignment.counted(reused=reused, cached=cached, restored=restored, prefilled=len(fresh),
                                 recomputed=recomputed)

    # ---- blocking steps (worker threads; the caller holds lock + lease) --------------
    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await self._backend.run_blocking(fn, *args)

    @asynccontextmanager
    async def _lease(self) -> AsyncIterator[KVSlot]:
        """The pool's lease on this session's slot; a session put back into a slot first has
        its backend make room there for the KV it brings (or re-prefills)."""
        async with self._backend.pool.lease(self, prepare=self._make_room_to_adopt) as slot:
            yield slot

    async def _make_room_to_adopt(self, slot: KVSlot) -> None:
        """Room in the newly bound ``slot`` for the KV ``adopt`` puts there (KV held in pool
        blocks, a fork's, takes none)."""
        if not getattr(self._host, "in_pool", False):
            await self._backend.make_room(slot, len(self._log))

    def _load_blocking(self, slot: KVSlot, source: KVSource) -> None:
        self._log.load(slot, source, exact=self._backend.restores_exactly(source))

    # ---- other operations ------------------------------------------------------------
    async def next_token_logits(self) -> np.ndarray:
        """float32 logits ``[vocab]`` for the token after ``tokens``."""
        async with self._lock:
            self._ensure_open()
            log = self._log
            if not log.tokens:
                raise UserError("the session is empty: prefill or generate before asking for logits")
            async with self._lease() as slot:
                self.restored_tokens_pending = self.recomputed_tokens_pending = 0
                if log.last_logits is None:
                    last = log.tokens[-1]
                    await self._run(log.trim, slot, len(log) - 1)
                    async with self._backend.room(slot, 1):
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
            async with self._lease() as slot:
                await self._run(self._log.trim, slot, n)

    async def snapshot(self, *, start: int = 0) -> KVSnapshot:
        """A host copy of KV and tokens (``start``: of the tokens from there on, as a span)."""
        async with self._lock:
            self._ensure_open()
            held = await self._host_snapshot()
            if held is not None:
                return held.span(start, held.num_tokens) if start else held
            async with self._lease() as slot:
                return await self._run(self._backend.snapshot, self._log, slot, start)

    async def _host_snapshot(self) -> KVSnapshot | None:
        """The offloaded KV as a snapshot while the session has no slot; None when it is bound,
        holds nothing offloaded, or its host KV was dropped (a lease then re-prefills it)."""
        if self._backend.pool.is_bound(self) or self._host is None:
            return None
        return await self._run(self._host.load)

    async def restore(self, snapshot: KVSnapshot) -> None:
        """Replace KV and tokens by ``snapshot``'s (fresh state or nothing)."""
        if snapshot.fingerprint != self._backend.fingerprint:
            raise SnapshotIncompatible(
                f"snapshot was made by model {snapshot.fingerprint!r}, this engine runs "
                f"{self._backend.fingerprint!r}; re-prefill the history instead"
            )
        async with self._lock:
            self._ensure_open()
            if self._host is not None:  # the old KV is being replaced: don't bring it back first
                self._host.release()
                self._host = None
            self._log.forget()
            self.restored_tokens_pending = self.recomputed_tokens_pending = 0
            async with self._lease() as slot:
                async with self._backend.room(slot, snapshot.num_tokens, rewrite=True):
                    await self._run(self._load_blocking, slot, snapshot)
                self.restored_tokens_pending = snapshot.num_tokens

    async def fork(self) -> SlotSession:
        """A new session holding this KV (a host copy, or on the paged engine the same blocks,
        copied on write); it is put into a slot when it first runs."""
        async with self._lock:
            self._ensure_open()
            snapshot = await self._host_snapshot()
            held: OffloadedKV
            if snapshot is not None:
                held = await self._run(partial(self._backend.pool.host.put, snapshot, salt=self.salt))
            else:
                async with self._lease() as slot:
                    held = await self._run(partial(self._backend.hold, self._log, slot, salt=self.salt))
            log = self._log.copy()
        return type(self)(self._backend, log=log, held=held, salt=self.salt)

    async def check_integrity(self) -> None:
        """Raise ``KVLogCorrupt`` unless the KV (in a slot, or offloaded) holds exactly
        ``len(tokens)`` positions. Read-only; for tests and debugging."""
        async with self._lock:
            self._ensure_open()
            if self._backend.pool.is_bound(self):
                async with self._lease() as slot:
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
        convention = await self._backend.rope_convention()  # NOTE: before our lease: it needs a slot
        if convention is None:
            raise KVShiftUnsupported(
                "the model's keys fit no RoPE rotation, so a span cannot be dropped from the KV; "
                "use the Truncation policy (drop messages and re-prefill)"
            )
        async with self._lock:
            self._ensure_open()
            self._check_span(start, end)
            async with self._lease() as slot:
                async with self._backend.room(slot, len(self._log) - (end - start), rewrite=True):
                    await self._run(self._log.drop, slot, start, end, convention)

    async def close(self) -> None:
        """Release the slot and the KV (idempotent)."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            await self._backend.pool.release(self)
            # NOTE: after release: an offload of this session that was under way when close()
            # began has finished by now (the pool serialises them) and may have set _host.
            if self._host is not None:
                self._host.release()
                self._host = None
            self._log.forget()  # its KV is gone: the log says so
            self._backend.sessions.discard(self)
