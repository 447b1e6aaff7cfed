"""ScriptedSession: the scripted engine's KVSession, whose whole state is the token log.

Keeps the stateful session's observable behaviour — longest-common-prefix alignment (a fully
covered prompt still "prefills" its last token), the log holding every fed token, metrics,
errors, trim / fork / snapshot / restore — without a model::

    session = await engine.open_session()
    await session.prefill(ids)
    assert session.tokens == tuple(ids)
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import anyio
import anyio.lowlevel
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
from agentkv.engine.session_common import SessionCommon
from agentkv.engine.snapshot import KVSnapshot
from agentkv.errors import (
    SnapshotIncompatible,
    UserError,
)
from agentkv.testing.decode import ScriptedDecode, ScriptedHost, as_beam_search



class ScriptedEngineView(ScriptedHost, Protocol):
    """What a scripted session asks of its engine (``ScriptedEngine``)."""

    @property
    def tokenizer(self) -> Any: ...
    @property
    def fingerprint(self) -> str: ...
    prefill_s_per_token: float

    def begin_call(self, session_id: str, prompt: list[int], config: GenerationConfig, constrained: bool) -> Any: ...
    async def reply_for(self, call: Any) -> str: ...
    def new_session(self, **state: Any) -> ScriptedSession: ...
    def forget(self, session: ScriptedSession) -> None: ...


def scripted_logits(tokens: Sequence[int], vocab_size: int) -> np.ndarray:
    """Deterministic float32 logits ``[vocab_size]`` for a token log: equal logs, equal logits."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype="<i8").tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return rng.standard_normal(vocab_size, dtype=np.float32)


class ScriptedSession(SessionCommon):
    """A ``KVSession`` over a fictional KV: the token log is the whole state."""

    def __init__(self, engine: ScriptedEngineView, *, forked_from: KVSnapshot | None = None) -> None:
        """``forked_from``: the log a fork starts with (its KV counts as restored on first use)."""
        self._engine = engine
        self._id = uuid.uuid4().hex
        self._tokens: list[int] = list(forked_from.tokens) if forked_from else []
        self._logits_ready = False  # the "model" has fed tokens[-1] (the real _last_logits)
        self._shifted = forked_from.shifted if forked_from else False
        self._closed = False
        self._lock = anyio.Semaphore(1)  # as the real session: releasable by a finalizer task
        self.restored_tokens_pending = 0
        self.drops: list[tuple[int, int]] = []
        """Every ``drop(start, end)`` applied, in order (for tests)."""

    @property
    def engine(self) -> ScriptedEngineView:
        """The engine that opened this session."""
        return self._engine

    # ---- generation ------------------------------------------------------------------
    async def prefill(self, prompt_tokens: Sequence[int]) -> GenerationMetrics:
        """Align to ``prompt_tokens`` without generating (consumes no step)."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, GenerationConfig(max_new_tokens=0))
        async with self._lock:
            self._ensure_open()
            started = time.perf_counter()
            align = await self._align(prompt)
            elapsed = time.perf_counter() - started
            return self._engine.metrics_for(self, align, generated=0, ttft=elapsed, tpot=0.0)

    async def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        async with self._lock:
            self._ensure_open()
            engine = self._engine
            call = engine.begin_call(self._id, prompt, config, constraint is not None)
            reply_ids = engine.tokenizer.encode(await engine.reply_for(call))
            started = time.perf_counter()
            align = await self._align(prompt)
            decode = ScriptedDecode(self, prompt, config, constraint, align, started)
            events = decode.run(reply_ids)
            if config.num_beams > 1:
                events = as_beam_search(events)
            async for event in events:
                if isinstance(event, GenerationResult):
                    call.result = event
                yield event

    async def _align(self, prompt: list[int]) -> Alignment:
        """Trim the log to the longest common prefix with ``prompt``, "prefill" the rest."""
        restored, self.restored_tokens_pending = self.restored_tokens_pending, 0
        reused = common_prefix_len(self._tokens, prompt)
        if reused == len(prompt) == len(self._tokens) and self._logits_ready:
            return Alignment(reused=reused, prefix_cache=0, restored=restored, prefilled=0)
        # NOTE: a prompt fully covered by the KV still needs its last token fed to get logits.
        reused = min(reused, len(prompt) - 1)
        self._trim_to(reused)
        await self.feed(prompt[reused:], self._engine.prefill_s_per_token)
        return Alignment(reused=reused, prefix_cache=0, restored=min(restored, reused), prefilled=len(prompt) - reused)

    async def feed(self, ids: Sequence[int], seconds_per_token: float) -> None:
        """Run ``ids`` through the "model": they join the log once the step completes.

        Like a real model step in a worker thread, a started step is not abandoned on
        cancellation: it finishes (log updated), then the cancellation is delivered.
        """
        with anyio.CancelScope(shield=True):
            if seconds_per_token > 0:
                await anyio.sleep(seconds_per_token * len(ids))
            self._tokens.extend(int(t) for t in ids)
            self._logits_ready = True
        await anyio.lowlevel.checkpoint()

    def _trim_to(self, n: int) -> None:
        if n < len(self._tokens):
            del self._tokens[n:]
            self._logits_ready = False
            if n == 0:
                self._shifted = False

    # ---- other operations ------------------------------------------------------------
    async def next_token_logits(self) -> np.ndarray:
        """Deterministic float32 logits ``[n_vocab]`` derived from ``tokens``."""
        async with self._lock:
            self._ensure_open()
            if not self._tokens:
                raise UserError("the session is empty: prefill or generate before asking for logits")
            self.restored_tokens_pending = 0
            if not self._logits_ready:
                last = self._tokens[-1]
                self._trim_to(len(self._tokens) - 1)
                await self.feed([last], self._engine.prefill_s_per_token)
            return scripted_logits(self._tokens, self._engine.tokenizer.n_vocab)

    async def trim(self, n: int) -> None:
        """Keep the first ``n`` tokens of the log."""
        if n < 0:
            raise UserError(f"trim(n) needs n >= 0, got {n}")
        async with self._lock:
            self._ensure_open()
            self._trim_to(n)

    async def snapshot(self) -> KVSnapshot:
        """An f32 snapshot of the log with zero K/V arrays ``[1, 1, 1, T, 1]``."""
        async with self._lock:
            self._ensure_open()
            return self._snapshot_now()

    def _snapshot_now(self) -> KVSnapshot:
        zeros = np.zeros((1, 1, 1, len(self._tokens), 1), dtype=np.float32)
        return KVSnapshot.from_float(
            tuple(self._tokens), zeros, zeros, precision="f32",
            fingerprint=self._engine.fingerprint, shifted=self._shifted,
        )

    async def restore(self, snapshot: KVSnapshot) -> None:
        """Replace the log by ``snapshot``'s; another fingerprint raises ``SnapshotIncompatible``."""
        if snapshot.fingerprint != self._engine.fingerprint:
            raise SnapshotIncompatible(
                f"snapshot was made by model {snapshot.fingerprint!r}, this engine runs "
                f"{self._engine.fingerprint!r}; re-prefill the history instead"
            )
        async with self._lock:
            self._ensure_open()
            self._tokens = list(snapshot.tokens)
            self._logits_ready = False
            self._shifted = snapshot.shifted
            self.restored_tokens_pending = snapshot.num_tokens

    async def fork(self) -> ScriptedSession:
        """A new session with a copy of this log; its KV counts as restored when it first runs."""
        async with self._lock:
            self._ensure_open()
            snap = self._snapshot_now()
        child = self._engine.new_session(forked_from=snap)
        child.restored_tokens_pending = snap.num_tokens
        return child

    @property
    def supports_drop(self) -> bool:
        """True: the scripted KV can drop a span (its "RoPE" is always known)."""
        return True

    async def drop(self, start: int, end: int) -> None:
        """Remove ``tokens[start:end]`` as the stateful session's KV-level drop does (no prefill;
        marks the session ``shifted``); ``UserError`` for a span outside ``tokens``."""
        async with self._lock:
            self._check_span(start, end)
            if start == end:
                return
            del self._tokens[start:end]
            self._logits_ready = False
            self._shifted = True
            self.drops.append((start, end))

    async def close(self) -> None:
        """Drop the log (idempotent)."""
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tokens, self._logits_ready = [], False
            self._engine.forget(self)
