"""RoPE measured from the model itself, and the re-rotation of cached keys by −Δ positions.

A stateful model stores its keys *after* the rotary embedding, so removing a span of tokens
from the KV (``KVSession.drop``) must rotate every later key back by the span's length to keep
positions contiguous. Which rotation the model uses is measured, not looked up: the same tokens
are prefilled at position offsets 0 and p, and the rotation mapping one key state onto the
other is fitted — pairing of dimensions (rotate-half or interleaved), the angular frequency of
every pair, and from those θ and a linear position scale::

    convention = await rope_convention(engine)     # None when no rotation explains the keys
    keys = convention.rotate(keys, -40)            # [..., T, head_dim], every token by −40
    keys, values = drop_span(keys, values, 10, 50, convention)
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import anyio
import numpy as np

from agentkv.errors import AgentKVError

if TYPE_CHECKING:
    from agentkv.engine.slot import Slot
    from agentkv.engine.stateful import StatefulEngine

logger = logging.getLogger(__name__)

RopeStyle = Literal["rotate_half", "interleaved", "none"]
PROBE_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea."
PROBE_OFFSETS = (1, 16, 256, 2048)
"""Offsets measured: 1 gives every frequency without wrap-around, larger ones refine it."""
FIT_TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "u8": 3e-2}
"""Largest error of the fitted rotation, relative to the largest key, accepted per KV cache
precision: keys are read back through the cache, so its rounding is the noise floor (measured
fit errors on the default model: 1.3e-5 f32, 6.2e-3 u8; a wrong pairing gives ~1)."""
_PARAMETRIC_TOLERANCE = 1e-2
"""Largest relative gap between measured frequencies and ``scale⁻¹·θ^(−2i/d)`` to report θ."""


@dataclass(frozen=True)
class RopeConvention:
    """How the model rotates keys by position: ``convention.rotate(keys, delta)``."""

    style: RopeStyle
    """Which dimensions form a rotated pair: (i, i + d/2), (2i, 2i + 1), or no rotation at all."""
    inv_freq: tuple[float, ...]
    """Radians per position of each pair (empty for ``"none"``)."""
    theta: float | None
    """The base θ when the frequencies follow ``scale⁻¹·θ^(−2i/d)`` (None otherwise)."""
    scale: float | None
    """The linear position-scaling factor of that fit (1.0 = unscaled)."""
    fit_error: float
    """Largest error of the fitted rotation on the probe, relative to the largest key."""

    def rotate(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """``keys`` ``[..., T, head_dim]`` as if every token sat ``delta`` positions later."""
        if self.style == "none" or delta == 0:
            return keys.copy()
        return rotate_pairs(keys, self.style, np.asarray(self.inv_freq), float(delta))


def pair_slices(style: RopeStyle, head_dim: int) -> tuple[slice, slice]:
    """The (first, second) dimensions of the rotated pairs, as slices (views, no copies):
    ``pair_slices("rotate_half", 64) == (slice(0, 32), slice(32, 64))``."""
    half = head_dim // 2
    if style == "rotate_half":
        return slice(0, half), slice(half, 2 * half)
    return slice(0, 2 * half, 2), slice(1, 2 * half, 2)


def rotate_pairs(
    keys: np.ndarray, style: RopeStyle, inv_freq: np.ndarray, positions: float, out: np.ndarray | None = None
) -> np.ndarray:
    """Rotate each pair (a, b) of ``keys`` ``[..., dim]`` by ``positions × inv_freq`` radians,
    into ``out`` (same shape, not overlapping ``keys``; a new float32 array by default)."""
    first, second = pair_slices(style, keys.shape[-1])
    angle = positions * np.asarray(inv_freq, dtype=np.float64)  # [pairs]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    a, b = keys[..., first], keys[..., second]
    if out is None:
        out = np.empty(keys.shape, dtype=np.float32)
    if keys.shape[-1] % 2:
        out[..., -1] = keys[..., -1]  # an odd last dimension is not rotated
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def drop_span(
    keys: np.ndarray, values: np.ndarray, start: int, end: int, convention: RopeConvention
) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[..., T, dim]`` without tokens ``start:end``; later keys rotated by −(end−start)."""
    shape = (*keys.shape[:-2], keys.shape[-2] - (end - start), keys.shape[-1])
    kept_keys = np.empty(shape, dtype=np.float32)
    kept_keys[..., :start, :] = keys[..., :start, :]
    if convention.style == "none":
        kept_keys[..., start:, :] = keys[..., end:, :]
    else:
        inv_freq = np.asarray(convention.inv_freq)
        rotate_pairs(keys[..., end:, :], convention.style, inv_freq, -float(end - start), out=kept_keys[..., start:, :])
    kept_values = np.concatenate([values[..., :start, :], values[..., end:, :]], axis=-2)
    return kept_keys, kept_values


def _pair_angles(base: np.ndarray, moved: np.ndarray, style: RopeStyle) -> np.ndarray:
    """Per pair, the angle (−π, π] rotating ``base`` onto ``moved``, pooled over every key."""
    first, second = pair_slices(style, base.shape[-1])
    z_base = base[..., first].astype(np.float64) + 1j * base[..., second].astype(np.float64)
    z_moved = moved[..., first].astype(np.float64) + 1j * moved[..., second].astype(np.float64)
    pooled = (z_moved * np.conj(z_base)).reshape(-1, z_base.shape[-1]).sum(axis=0)
    return np.angle(pooled)


def _relative_error(predicted: np.ndarray, actual: np.ndarray) -> float:
    return float(np.max(np.abs(predicted - actual)) / max(float(np.max(np.abs(actual))), 1e-12))


def _fit_style(base: np.ndarray, moved: Mapping[int, np.ndarray], style: RopeStyle) -> tuple[np.ndarray, float]:
    """Unwrapped frequencies from the smallest offset upward, and the worst fit error."""
    omega: np.ndarray | None = None
    for offset in sorted(moved):
        phi = _pair_angles(base, moved[offset], style)
        if omega is None:
            omega = phi / offset
        else:
            turns = np.round((omega * offset - phi) / (2 * math.pi))
            omega = (phi + 2 * math.pi * turns) / offset
    assert omega is not None
    error = max(_relative_error(rotate_pairs(base, style, omega, p), k) for p, k in moved.items())
    return omega, error


def _parametric(omega: np.ndarray, head_dim: int) -> tuple[float, float] | None:
    """(θ, scale) when ``omega[i] == θ^(−2i/d) / scale`` for every pair, else None."""
    if np.any(omega <= 0):
        return None
    exponent = 2 * np.arange(len(omega)) / head_dim
    # NOTE: weights ω: a measured angle's noise is about the same for every pair, so log ω is
    # noisiest where ω is small — and high frequencies are where a slope error costs most.
    slope, intercept = np.polyfit(exponent, np.log(omega), 1, w=omega)
    fitted = np.exp(intercept + slope * exponent)
    if np.max(np.abs(fitted / omega - 1)) > _PARAMETRIC_TOLERANCE:
        return None
    return float(np.exp(-slope)), float(np.exp(-intercept))


def fit_convention(
    base: np.ndarray, moved: Mapping[int, np.ndarray], *, tolerance: float = FIT_TOLERANCE["f32"]
) -> RopeConvention | None:
    """Fit the rotation mapping keys prefilled at offset 0 (``base``, ``[..., T, dim]``) onto the
    same tokens' keys at each offset p (``moved[p]``); None when no rotation explains them
    within ``tolerance`` (relative to the largest key)."""
    if not moved or min(moved) < 1:
        raise ValueError("fit_convention needs keys at positive offsets, the smallest ideally 1")
    if max(_relative_error(base, k) for k in moved.values()) <= tolerance:
        return RopeConvention("none", (), None, None, 0.0)  # keys do not depend on position
    fits = {style: _fit_style(base, moved, style) for style in ("rotate_half", "interleaved")}
    style: RopeStyle = min(fits, key=lambda s: fits[s][1])  # type: ignore[assignment]
    omega, error = fits[style]
    if error > tolerance:
        logger.warning("no RoPE rotation explains the model's keys (best fit error %.2e)", error)
        return None
    params = _parametric(omega, base.shape[-1])
    if params is not None:
        # NOTE: the closed form is exact where the measurement is noisy (low frequencies, u8 KV).
        theta, scale = params
        exact = np.exp(-np.log(scale) - np.log(theta) * 2 * np.arange(len(omega)) / base.shape[-1])
        exact_error = max(_relative_error(rotate_pairs(base, style, exact, p), k) for p, k in moved.items())
        if exact_error <= tolerance:
            return RopeConvention(style, tuple(float(w) for w in exact), theta, scale, exact_error)
    return RopeConvention(style, tuple(float(w) for w in omega), None, None, error)


def prefill_at_offset(slot: Slot, ids: Sequence[int], offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty ``slot``, prefill ``ids`` at positions ``offset..offset+T-1``; return float32
    K, V ``[layers, 1, heads, T, dim]`` and the last position's logits ``[vocab]``. Blocking;
    the slot keeps that KV (a test helper too: ``prefill_at_offset(slot, ids, 100)``)."""
    slot.reset()
    logits = slot.feed(np.array([list(ids)], dtype=np.int64), past_len=0, position_offset=offset)
    keys, values = slot.read()
    return keys, values, logits[0]


def measure_keys(slot: Slot, ids: Sequence[int], offsets: Sequence[int]) -> dict[int, np.ndarray]:
    """Keys ``[layers, batch, heads, T, dim]`` of ``ids`` prefilled at each offset (0 included).

    Blocking; empties the slot afterwards. Raises ``UserError`` for models without
    ``position_ids``."""
    try:
        return {offset: prefill_at_offset(slot, ids, offset)[0] for offset in (0, *offsets)}
    finally:
        slot.reset()


_MEASURED: weakref.WeakKeyDictionary[object, RopeConvention | None] = weakref.WeakKeyDictionary()
"""One measurement per engine (weak: it goes with the engine)."""


async def rope_convention(engine: StatefulEngine) -> RopeConvention | None:
    """The engine's RoPE convention, measured once on a temporary session's slot; None if the
    keys fit no rotation (then KV-level span drops are unavailable).

    Must not be called while holding a slot lease (it needs a slot of its own)."""
    if engine in _MEASURED:
        return _MEASURED[engine]
    ids = engine.tokenizer.encode(PROBE_TEXT)
    probe = engine.new_session()
    try:
        async with engine.pool.lease(probe) as slot:
            keys = await anyio.to_thread.run_sync(
                measure_keys, slot, ids, PROBE_OFFSETS, limiter=engine.pool.limiter
            )
    except AgentKVError as error:
        logger.warning("cannot measure the model's RoPE convention: %s", error)
        keys = {}
    finally:
        await probe.close()
    base = keys.pop(0, None)
    tolerance = FIT_TOLERANCE.get(engine.kv_cache_precision, max(FIT_TOLERANCE.values()))
    convention = fit_convention(base, keys, tolerance=tolerance) if base is not None else None
    _MEASURED[engine] = convention
    if convention is not None:
        logger.info("RoPE measured: %s, θ=%s, scale=%s, fit error %.1e", convention.style,
                    convention.theta, convention.scale, convention.fit_error)
    return convention
