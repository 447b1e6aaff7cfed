"""Self-check mode: for a sampled model call, compare the first-token logits of the cached path
with those of a scratch session that prefills the same prompt from zero — max abs difference,
KL divergence, argmax agreement — against the tolerance of the engine's numerics.

``Runtime(engine, self_check=0.05)`` (or ``AGENTKV_SELF_CHECK=0.05``) checks 5% of calls; off by
default. Results land in ``RunResult.self_checks`` and a log line; a violation is a
``SelfCheckFailed`` event carrying the conversation id and the operations since the last check::

    runtime = Runtime(engine, self_check=1.0)
    result = await runtime.run(conversation, "hi")
    result.self_checks[0].max_abs_diff, result.self_checks[0].passed

Cost: a fork of the conversation's KV (block sharing on the paged engine, a copy on the stateful one)
and one cold prefill of the prompt per checked call (see the README's measured figure).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.engine.base import Engine, KVSession
from agentkv.errors import UserError

logger = logging.getLogger(__name__)
ENV_SELF_CHECK = "AGENTKV_SELF_CHECK"
SCRATCH_SALT = "agentkv-self-check"
"""The scratch session's tenant: nothing is cached under it, so its prefill starts from zero."""


@dataclass(frozen=True)
class Tolerance:
    """How far the cached path may be from a fresh prefill on this engine's numerics."""

    max_abs: float
    """The largest absolute difference allowed between any two next-token logits."""
    kl: float
    """The largest KL divergence (nats) allowed between the two next-token distributions."""
    exact: bool
    """True for f32 numerics (``exact=True``): only chunking noise (~5e-5) is allowed."""


EXACT_TOLERANCE = Tolerance(max_abs=1e-3, kl=1e-6, exact=True)
DEFAULT_TOLERANCE = Tolerance(max_abs=2.0, kl=0.05, exact=False)
"""bf16 compute or dynamic quantisation: two chunkings differ by up to ~1 max abs logit on the
default model (``engine/numerics.py``); a cache fault is far larger."""


@dataclass(frozen=True)
class SelfCheckResult:
    """One checked call: the cached path against a fresh prefill of the same prompt."""

    call_index: int
    """0-based index of the model call within the run."""
    prompt_tokens: int
    """Tokens of the prompt both paths computed the next-token logits for."""
    max_abs_diff: float
    """The largest absolute difference between the cached path's and the fresh prefill's logits."""
    kl: float
    """KL(fresh ‖ cached) in nats: the fresh prefill's next-token distribution against the cached path's."""
    argmax_agrees: bool
    """Whether both paths' likeliest next token is the same."""
    tolerance: Tolerance
    """The bounds it was held to (this engine's numerics: ``EXACT_TOLERANCE`` or ``DEFAULT_TOLERANCE``)."""
    cost_s: float
    """What the check took (a fork and a cold prefill)."""

    @property
    def passed(self) -> bool:
        return (self.max_abs_diff <= self.tolerance.max_abs and self.kl <= self.tolerance.kl
                and (self.argmax_agrees or not self.tolerance.exact))

    def describe(self) -> str:
        verdict = "ok" if self.passed else "VIOLATION"
        return (f"self-check {verdict}: model call {self.call_index}, {self.prompt_tokens} prompt tokens, "
                f"max abs logit diff {self.max_abs_diff:.3g} (≤ {self.tolerance.max_abs:g}), "
                f"KL {self.kl:.3g} (≤ {self.tolerance.kl:g}), "
                f"argmax {'agrees' if self.argmax_agrees else 'differs'}, {self.cost_s * 1000:.0f} ms")


def fraction_from(value: float | None) -> float:
    """The fraction of calls to check: ``value``, else ``$AGENTKV_SELF_CHECK``, else 0."""
    if value is None:
        raw = os.environ.get(ENV_SELF_CHECK, "").strip()
        try:
            value = float(raw) if raw else 0.0
        except ValueError:
            raise UserError(f"{ENV_SELF_CHECK} must be a fraction of calls between 0 and 1, got {raw!r}") from None
    if not 0.0 <= value <= 1.0:
        raise UserError(f"self_check must be a fraction of calls between 0 and 1, got {value}")
    return value


def tolerance_for(engine: Engine) -> Tolerance:
    """The tolerance of the engine's numerics (exact: f32 compute, no dynamic quantisation)."""
    return EXACT_TOLERANCE if engine.exact else DEFAULT_TOLERANCE


async def check_call(engine: Engine, kv: KVSession, prompt: Sequence[int], call_index: int) -> SelfCheckResult:
    """Compare the logits after ``prompt`` on ``kv`` (which holds it, and maybe an answer after
    it) with a scratch session's cold prefill; ``kv`` itself is left as it was."""
    started = time.perf_counter()
    probe = await kv.fork()
    try:
        await probe.trim(len(prompt))
        cached = np.asarray(await probe.next_token_logits(), dtype=np.float64)
    finally:
        await probe.close()
    scratch = await engine.open_session(salt=SCRATCH_SALT)
    try:
        await scratch.prefill(prompt)
        fresh = np.asarray(await scratch.next_token_logits(), dtype=np.float64)
    finally:
        await scratch.close()
    return SelfCheckResult(call_index, len(prompt), float(np.max(np.abs(cached - fresh))), _kl(fresh, cached),
                           int(np.argmax(cached)) == int(np.argmax(fresh)), tolerance_for(engine),
                           time.perf_counter() - started)


def _kl(reference: np.ndarray[Any, Any], other: np.ndarray[Any, Any]) -> float:
    """KL(softmax(reference) ‖ softmax(other))."""
    p = _log_softmax(reference)
    q = _log_softmax(other)
    return float(max(0.0, np.sum(np.exp(p) * (p - q))))


def _log_softmax(logits: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    shifted: np.ndarray[Any, Any] = logits - np.max(logits)
    result: np.ndarray[Any, Any] = shifted - np.log(np.sum(np.exp(shifted)))
    return result
