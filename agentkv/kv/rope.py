"""RoPE from the model's metadata, verified on its own keys, and the re-rotation of cached keys by −Δ.

A stateful model stores its keys *after* the rotary embedding, so removing a span of tokens
from the KV (``KVSession.drop``) must rotate every later key back by the span's length to keep
positions contiguous. θ and linear scaling come from the model's metadata (GGUF
``*.rope.freq_base`` / ``*.rope.scaling.*``, config.json ``rope_theta`` / ``rope_scaling``) and
are verified: the same tokens are prefilled at position offsets 0 and p and the rotation must
map one key state onto the other — on layer 0, whose keys pass through no attention, within a
tolerance derived from noise measured on the running machine (the probe prefilled again in two
chunks). Without metadata (or when it fails) the rotation is fitted there — pairing of
dimensions (rotate-half or interleaved) and every pair's frequency. Then every layer must be
explained by it far better than by no rotation (deeper keys also carry the noise of attention
computed at other positions: ~3e-2 with bf16 compute)::

    convention = await engine.rope_convention()     # None when no rotation explains the keys
    keys = convention.rotate(keys, -40)            # [..., T, head_dim], every token by −40
    keys, values = drop_span(keys, values, 10, 50, convention)
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np

logger = logging.getLogger(__name__)


class ProbeSlot(Protocol):
    """What measuring a model's RoPE needs from a KV slot (the stateful engine's
    ``StatefulSlot`` has it): feed ids at a position offset, read the KV as arrays, empty it."""

    def feed(self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None,
             position_offset: int = 0) -> np.ndarray: ...
    def read(self) -> tuple[np.ndarray, np.ndarray]: ...
    def reset(self) -> None: ...

RopeStyle = Literal["rotate_half", "interleaved", "none"]
ROTATING_STYLES: tuple[RopeStyle, ...] = ("rotate_half", "interleaved")
"""The pairings a RoPE fit tries (``"none"``: keys that ignore position)."""
PROBE_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea."
PROBE_OFFSETS = (1, 16, 256, 2048)
"""Offsets measured: 1 gives every frequency without wrap-around, larger ones refine it."""
FIT_TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "bf16": 1e-2, "u8": 3e-2}
"""Floor of the accepted error of a rotation, relative to the largest key, per KV cache
precision: keys are read back through the cache, so its rounding is the least noise there is
(measured on the default model, exact numerics: 2e-5 f32; layer 0 with bf16 compute: 2.5e-3
f16, 6e-3 u8; a wrong pairing gives ~1)."""
NOISE_FACTOR = 3.0
"""The tolerance is at least this many times the chunking noise measured on the probe
(measured: fit error / noise 1.0–1.6 with dynamic quantisation and bf16 compute on)."""
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
    """Largest error of the rotation on the probe's layer-0 keys (or the keys it was fitted on),
    relative to the largest key."""
    source: Literal["metadata", "fitted", "given"] = "given"
    """Where θ came from: the model's metadata (verified), a fit on its keys, or a caller."""
    tolerance: float = 0.0
    """The tolerance ``fit_error`` was checked against (0 when not measured)."""

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
    return np.asarray(np.angle(pooled))


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
    base: np.ndarray,
    moved: Mapping[int, np.ndarray],
    *,
    tolerance: float = FIT_TOLERANCE["f32"],
) -> RopeConvention | None:
    """Fit the rotation mapping keys prefilled at offset 0 (``base``, ``[..., T, dim]``) onto the
    same tokens' keys at each offset p (``moved[p]``); None when no rotation explains them
    within ``tolerance`` (relative to the largest key)."""
    if not moved or min(moved) < 1:
        raise ValueError("fit_convention needs keys at positive offsets, the smallest ideally 1")
    if max(_relative_error(base, k) for k in moved.values()) <= tolerance:
        return RopeConvention("none", (), None, None, 0.0, "fitted", tolerance)  # keys ignore position
    fits = {style: _fit_style(base, moved, style)[0] for style in ROTATING_STYLES}
    errors = {style: rotation_error(base, moved, style, omega) for style, omega in fits.items()}
    style = min(errors, key=errors.__getitem__)
    omega, error = fits[style], errors[style]
    if error > tolerance:
        logger.warning("no RoPE rotation explains the model's keys (best fit error %.2e, tolerance %.2e)",
                       error, tolerance)
        return None
    params = _parametric(omega, base.shape[-1])
    if params is not None:
        # NOTE: the closed form is exact where the measurement is noisy (low frequencies, u8 KV).
        theta, scale = params
        exact = theta_frequencies(theta, scale, base.shape[-1])
        exact_error = rotation_error(base, moved, style, exact)
        if exact_error <= tolerance:
            return RopeConvention(style, tuple(float(w) for w in exact), theta, scale, exact_error,
                                  "fitted", tolerance)
    return RopeConvention(style, tuple(float(w) for w in omega), None, None, error, "fitted", tolerance)


def theta_frequencies(theta: float, scale: float, head_dim: int) -> np.ndarray:
    """Radians per position of each pair: ``θ^(−2i/d) / scale``."""
    return np.asarray(np.exp(-np.log(scale) - np.log(theta) * 2 * np.arange(head_dim // 2) / head_dim))


def rotation_error(base: np.ndarray, moved: Mapping[int, np.ndarray], style: RopeStyle, inv_freq: np.ndarray) -> float:
    """Worst relative error of rotating ``base`` onto ``moved[p]`` by p positions, over every p."""
    return max(_relative_error(rotate_pairs(base, style, inv_freq, p), k) for p, k in moved.items())


def convention_from_metadata(
    theta: float, scale: float, base: np.ndarray, moved: Mapping[int, np.ndarray], *, tolerance: float
) -> RopeConvention | None:
    """The metadata's θ and linear scale in whichever pairing explains the keys, or None when
    neither does within ``tolerance``."""
    inv_freq = theta_frequencies(theta, scale, base.shape[-1])
    errors = {style: rotation_error(base, moved, style, inv_freq) for style in ROTATING_STYLES}
    style = min(errors, key=errors.__getitem__)
    if errors[style] > tolerance:
        logger.warning("the model's metadata RoPE (θ=%s, scale=%s) does not explain its keys "
                       "(error %.2e, tolerance %.2e); fitting instead", theta, scale, errors[style], tolerance)
        return None
    return RopeConvention(style, tuple(float(w) for w in inv_freq), theta, scale, errors[style],
                          "metadata", tolerance)


def rope_metadata(config: Mapping[str, Any], gguf: Mapping[str, Any]) -> tuple[float, float] | None:
    """(θ, linear scale) from config.json or GGUF metadata; None when neither states θ or the
    scaling is not linear (``rope_metadata({"rope_theta": 1e4}, {}) == (1e4, 1.0)``)."""
    theta = config.get("rope_theta")
    scaling: Any = config.get("rope_scaling")
    if theta is None:
        theta = next((v for k, v in gguf.items() if k.endswith(".rope.freq_base")), None)
        kind = next((v for k, v in gguf.items() if k.endswith(".rope.scaling.type")), None)
        factor = next((v for k, v in gguf.items() if k.endswith(".rope.scaling.factor")), None)
        scaling = None if kind in (None, "none") else {"type": kind, "factor": factor}
    if theta is None:
        return None
    if not scaling:
        return float(theta), 1.0
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "linear" or not scaling.get("factor"):
        return None  # yarn, llama3, dynamic…: the fit finds the frequencies
    return float(theta), float(scaling["factor"])


def prefill_at_offset(slot: ProbeSlot, ids: Sequence[int], offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty ``slot``, prefill ``ids`` at positions ``offset..offset+T-1``; return float32
    K, V ``[layers, 1, heads, T, dim]`` and the last position's logits ``[vocab]``. Blocking;
    the slot keeps that KV (a test helper too: ``prefill_at_offset(slot, ids, 100)``)."""
    slot.reset()
    logits = slot.feed(np.array([list(ids)], dtype=np.int64), past_len=0, position_offset=offset)
    keys, values = slot.read()
    return keys, values, logits[0]


def measure_keys(slot: ProbeSlot, ids: Sequence[int], offsets: Sequence[int]) -> dict[int, np.ndarray]:
    """Keys ``[layers, batch, heads, T, dim]`` of ``ids`` prefilled at each offset (0 included).

    Blocking; empties the slot afterwards. Raises ``UserError`` for models without
    ``position_ids``."""
    try:
        return {offset: prefill_at_offset(slot, ids, offset)[0] for offset in (0, *offsets)}
    finally:
        slot.reset()


def chunking_noise(slot: ProbeSlot, ids: Sequence[int], offsets: Sequence[int], keys: Mapping[int, np.ndarray]) -> float:
    """Relative difference between ``keys[p]`` (one-pass prefills) and the same prefill cut in
    two chunks, worst over ``offsets``: how far two computations of the same keys drift apart
    on this machine's numerics. Blocking; empties the slot afterwards."""
    half = max(1, len(ids) // 2)
    worst = 0.0
    try:
        for offset in offsets:
            slot.reset()
            slot.feed(np.array([list(ids[:half])], dtype=np.int64), past_len=0, position_offset=offset)
            slot.feed(np.array([list(ids[half:])], dtype=np.int64), past_len=half, position_offset=offset)
            worst = max(worst, _relative_error(slot.read()[0], keys[offset]))
    finally:
        slot.reset()
    return worst


def measure_convention(
    slot: ProbeSlot, ids: Sequence[int], *, floor: float, metadata: tuple[float, float] | None
) -> RopeConvention | None:
    """Measure the slot's RoPE: keys at ``PROBE_OFFSETS`` and the machine's noise; the metadata's
    θ verified (or a fit) on layer 0 — whose keys pass through no attention, so only rounding
    separates them from an exact rotation — against ``max(floor, NOISE_FACTOR × noise)``; then
    every layer must be explained by that rotation far better than by none (a layer without
    RoPE, or another rotation, makes the convention unusable for span drops). Blocking."""
    keys = measure_keys(slot, ids, PROBE_OFFSETS)
    noise = chunking_noise(slot, ids, (0, max(PROBE_OFFSETS)), keys)
    tolerance = max(floor, NOISE_FACTOR * noise)
    base = keys.pop(0)
    first = {p: k[:1] for p, k in keys.items()}
    convention = None
    if metadata is not None:
        convention = convention_from_metadata(*metadata, base[:1], first, tolerance=tolerance)
    if convention is None:
        convention = fit_convention(base[:1], first, tolerance=tolerance)
    if convention is None or convention.style == "none":
        return convention
    worst = _worst_layer(convention, base, keys)
    if worst is not None:
        logger.warning("RoPE θ=%s does not explain layer %d of the model's keys (rotated error %.2e vs %.2e "
                       "unrotated); span drops are unavailable", convention.theta, *worst)
        return None
    logger.info("RoPE (%s): %s, θ=%s, scale=%s, layer-0 error %.1e within %.1e (noise %.1e)", convention.source,
                convention.style, convention.theta, convention.scale, convention.fit_error, tolerance, noise)
    return convention


DEPTH_MARGIN = 0.5
"""Every layer's keys must fit the rotation with at most this fraction of the unrotated error
(measured: ≤0.04 rotated vs ~1 unrotated with bf16 compute; a layer without RoPE gives ≫1)."""


def _worst_layer(
    convention: RopeConvention, base: np.ndarray, moved: Mapping[int, np.ndarray]
) -> tuple[int, float, float] | None:
    """(layer, rotated error, unrotated error) of the first layer the rotation does not explain."""
    inv_freq = np.asarray(convention.inv_freq)
    for layer in range(base.shape[0]):
        layer_moved = {p: k[layer] for p, k in moved.items()}
        rotated = rotation_error(base[layer], layer_moved, convention.style, inv_freq)
        unrotated = max(_relative_error(base[layer], k) for k in layer_moved.values())
        if rotated > DEPTH_MARGIN * unrotated:
            return layer, rotated, unrotated
    return None
