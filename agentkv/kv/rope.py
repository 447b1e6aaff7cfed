"""RoPE from the model's metadata, verified on its own keys, and the re-rotation of cached keys by −Δ.

A stateful model stores its keys *after* the rotary embedding, so removing a span of tokens
from the KV (``KVSession.drop``) must rotate every later key back by the span's length to keep
positions contiguous. θ, scaling, the rotated dims and per-layer θ come from the model's
metadata (``kv/rope_metadata.py``) and are verified — exact or fp16-rounded frequencies, as an
fp16 IR stores them: the same tokens are prefilled at position offsets 0 and p and the rotation
must map one key state onto the other — on layer 0, whose keys pass through no attention, within
a tolerance derived from noise measured on the running machine (the probe prefilled again in two
chunks). Without metadata (or when it fails) the rotation is fitted there — pairing of
dimensions (rotate-half or interleaved), how many dims rotate, and every pair's frequency. Then
every layer must be explained by its own frequencies far better than by no rotation (deeper keys
also carry the noise of attention computed at other positions: ~3e-2 with bf16 compute)::

    convention = await engine.rope_convention()     # None when no rotation explains the keys
    keys = convention.rotate(keys, -40)            # [layers, ..., T, head_dim], every token by −40
    keys, values = drop_span(keys, values, 10, 50, convention)
    convention.for_layer(5).rotate(keys[5], -40)   # one layer's keys [..., T, head_dim]
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, Protocol

import numpy as np

from agentkv.kv.rope_metadata import ROUNDINGS, Rounding, RopeMetadata, rope_metadata

__all__ = ["FIT_TOLERANCE", "RopeConvention", "RopeMetadata", "drop_span", "fit_convention", "prefill_at_offset",
           "rope_metadata", "rotate_pairs"]

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
FIT_TOLERANCE = {"f32": 1e-3, "f16": 1e-2, "bf16": 1e-2, "u8": 3e-2}
"""Floor of the accepted error of a rotation, relative to the largest key, per KV cache
precision: keys are read back through the cache, so its rounding is the least noise there is
(measured on the default model, exact numerics: 2e-5 f32; layer 0 with bf16 compute: 2.5e-3
f16, 6e-3 u8; a wrong pairing gives ~1)."""
_PARAMETRIC_TOLERANCE = 1e-2
"""Largest relative gap between measured frequencies and ``scale⁻¹·θ^(−2i/d)`` to report θ."""


@dataclass(frozen=True)
class RopeConvention:
    """How the model rotates keys by position: ``convention.rotate(keys, delta)``."""

    style: RopeStyle
    """Which dimensions form a rotated pair: (i, i + r/2), (2i, 2i + 1) over the first r =
    ``rotary_dim`` dims (the rest pass through), or no rotation at all."""
    inv_freq: tuple[float, ...]
    """Radians per position of each pair (empty for ``"none"``); the frequencies actually used
    (fp16-rounded when those fit). With ``layer_inv_freq``: the global (``theta``) layers'."""
    theta: float | None
    """The base θ: the verified metadata's, or a fit's when the frequencies follow
    ``scale⁻¹·θ^(−2i/r)`` (None otherwise)."""
    scale: float | None
    """The linear position-scaling factor of that fit (1.0 = unscaled)."""
    fit_error: float
    """Largest error of the rotation on the probe's layer-0 keys (or the keys it was fitted on),
    relative to the largest key."""
    source: Literal["metadata", "fitted", "given"] = "given"
    """Where θ came from: the model's metadata (verified), a fit on its keys, or a caller."""
    tolerance: float = 0.0
    """The tolerance ``fit_error`` was checked against (0 when not measured)."""
    layer_inv_freq: tuple[tuple[float, ...], ...] = ()
    """One ``inv_freq`` per layer when layers differ (Gemma 3: θ 1e4 on sliding layers, 1e6 on
    global ones); empty: every layer uses ``inv_freq``. Arrays given to ``rotate`` /
    ``drop_span`` are then ``[layers, ...]``."""
    layer_theta: tuple[float, ...] = ()
    """θ of each layer, alongside ``layer_inv_freq``."""
    rounding: Rounding | None = None
    """How the metadata's frequencies matched the keys: ``"exact"`` or ``"fp16"``-rounded (an fp16
    IR's stored ``inv_freq``); None when not from metadata."""

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head rotate (``2 × len(inv_freq)``; the rest pass through)."""
        return 2 * len(self.inv_freq)

    def for_layer(self, layer: int) -> RopeConvention:
        """The one-θ convention of ``layer``: ``convention.for_layer(5).rotate(keys[5], -40)``."""
        if not self.layer_inv_freq:
            return self
        theta = self.layer_theta[layer] if self.layer_theta else self.theta
        return replace(self, inv_freq=self.layer_inv_freq[layer], theta=theta, layer_inv_freq=(), layer_theta=())

    def rotate(self, keys: np.ndarray, delta: int) -> np.ndarray:
        """``keys`` ``[..., T, head_dim]`` (``[layers, ..., T, head_dim]`` for a per-layer
        convention) as if every token sat ``delta`` positions later."""
        if self.style == "none" or delta == 0:
            return keys.copy()
        if self.layer_inv_freq:
            _check_layers(self, keys)
            return np.stack([self.for_layer(i).rotate(keys[i], delta) for i in range(keys.shape[0])])
        return rotate_pairs(keys, self.style, np.asarray(self.inv_freq), float(delta))


def _check_layers(convention: RopeConvention, keys: np.ndarray) -> None:
    if keys.ndim < 3 or keys.shape[0] != len(convention.layer_inv_freq):
        raise ValueError(f"a per-layer RoPE convention of {len(convention.layer_inv_freq)} layers needs keys "
                         f"[layers, ..., T, dim], got {keys.shape}; use convention.for_layer(i) for one layer")


def pair_slices(style: RopeStyle, head_dim: int, rotary_dim: int | None = None) -> tuple[slice, slice]:
    """The (first, second) dimensions of the rotated pairs among the first ``rotary_dim`` (default
    all) dims, as slices (views): ``pair_slices("rotate_half", 16, 12) == (slice(0, 6), slice(6, 12))``."""
    half = (head_dim if rotary_dim is None else rotary_dim) // 2
    if style == "rotate_half":
        return slice(0, half), slice(half, 2 * half)
    return slice(0, 2 * half, 2), slice(1, 2 * half, 2)


def rotate_pairs(
    keys: np.ndarray, style: RopeStyle, inv_freq: np.ndarray, positions: float, out: np.ndarray | None = None
) -> np.ndarray:
    """Rotate each pair (a, b) of ``keys`` ``[..., dim]`` by ``positions × inv_freq`` radians, into
    ``out`` (same shape, not overlapping ``keys``; a new float32 array by default). Pairs lie in
    the first ``2 × len(inv_freq)`` dims; the dims after them are copied unrotated."""
    rotary_dim = 2 * len(inv_freq)
    first, second = pair_slices(style, keys.shape[-1], rotary_dim)
    angle = positions * np.asarray(inv_freq, dtype=np.float64)  # [pairs]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    a, b = keys[..., first], keys[..., second]
    if out is None:
        out = np.empty(keys.shape, dtype=np.float32)
    if keys.shape[-1] > rotary_dim:
        out[..., rotary_dim:] = keys[..., rotary_dim:]  # partial rotary: the tail is not rotated
    out[..., first] = a * cos - b * sin
    out[..., second] = b * cos + a * sin
    return out


def drop_span(
    keys: np.ndarray, values: np.ndarray, start: int, end: int, convention: RopeConvention
) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[..., T, dim]`` (``[layers, ..., T, dim]`` for a per-layer convention) without
    tokens ``start:end``; later keys rotated by −(end−start), each layer by its own frequencies."""
    shape = (*keys.shape[:-2], keys.shape[-2] - (end - start), keys.shape[-1])
    kept_keys = np.empty(shape, dtype=np.float32)
    kept_keys[..., :start, :] = keys[..., :start, :]
    if convention.style == "none":
        kept_keys[..., start:, :] = keys[..., end:, :]
    elif convention.layer_inv_freq:
        _check_layers(convention, keys)
        for layer, layer_freq in enumerate(convention.layer_inv_freq):
            rotate_pairs(keys[layer, ..., end:, :], convention.style, np.asarray(layer_freq), -float(end - start),
                         out=kept_keys[layer, ..., start:, :])
    else:
        inv_freq = np.asarray(convention.inv_freq)
        rotate_pairs(keys[..., end:, :], convention.style, inv_freq, -float(end - start), out=kept_keys[..., start:, :])
    kept_values = np.concatenate([values[..., :start, :], values[..., end:, :]], axis=-2)
    return kept_keys, kept_values


def _pair_angles(base: np.ndarray, moved: np.ndarray, style: RopeStyle, rotary_dim: int) -> np.ndarray:
    """Per pair, the angle (−π, π] rotating ``base`` onto ``moved``, pooled over every key."""
    first, second = pair_slices(style, base.shape[-1], rotary_dim)
    z_base = base[..., first].astype(np.float64) + 1j * base[..., second].astype(np.float64)
    z_moved = moved[..., first].astype(np.float64) + 1j * moved[..., second].astype(np.float64)
    pooled = (z_moved * np.conj(z_base)).reshape(-1, z_base.shape[-1]).sum(axis=0)
    return np.asarray(np.angle(pooled))


def relative_error(predicted: np.ndarray, actual: np.ndarray) -> float:
    """Largest absolute gap between the two, relative to the largest ``actual`` value."""
    return float(np.max(np.abs(predicted - actual)) / max(float(np.max(np.abs(actual))), 1e-12))


def _fit_style(base: np.ndarray, moved: Mapping[int, np.ndarray], style: RopeStyle, rotary_dim: int) -> np.ndarray:
    """Unwrapped frequencies of the ``rotary_dim / 2`` pairs, from the smallest offset upward."""
    omega: np.ndarray | None = None
    for offset in sorted(moved):
        phi = _pair_angles(base, moved[offset], style, rotary_dim)
        if omega is None:
            omega = phi / offset
        else:
            turns = np.round((omega * offset - phi) / (2 * math.pi))
            omega = (phi + 2 * math.pi * turns) / offset
    assert omega is not None
    return omega


def _parametric(omega: np.ndarray, rotary_dim: int) -> tuple[float, float] | None:
    """(θ, scale) when ``omega[i] == θ^(−2i/r) / scale`` for every pair, else None."""
    if np.any(omega <= 0):
        return None
    exponent = 2 * np.arange(len(omega)) / rotary_dim
    # NOTE: weights ω: a measured angle's noise is about the same for every pair, so log ω is
    # noisiest where ω is small — and high frequencies are where a slope error costs most.
    slope, intercept = np.polyfit(exponent, np.log(omega), 1, w=omega)
    fitted = np.exp(intercept + slope * exponent)
    if np.max(np.abs(fitted / omega - 1)) > _PARAMETRIC_TOLERANCE:
        return None
    return float(np.exp(-slope)), float(np.exp(-intercept))


def unrotated_tail(base: np.ndarray, moved: Mapping[int, np.ndarray], tolerance: float) -> int:
    """How many trailing dims of the keys do not change between offsets (partial rotary's pass-through)."""
    change = np.max([np.abs(k - base).reshape(-1, base.shape[-1]).max(axis=0) for k in moved.values()], axis=0)
    still = change <= tolerance * max(float(np.max(np.abs(base))), 1e-12)
    count = 0
    while count < len(still) and still[len(still) - 1 - count]:
        count += 1
    return count


def fit_convention(
    base: np.ndarray,
    moved: Mapping[int, np.ndarray],
    *,
    tolerance: float = FIT_TOLERANCE["f32"],
    rotary_dim: int | None = None,
) -> RopeConvention | None:
    """Fit the rotation mapping keys prefilled at offset 0 (``base``, ``[..., T, dim]``) onto the
    same tokens' keys at each offset p (``moved[p]``); None when no rotation explains them
    within ``tolerance`` (relative to the largest key). Tries every dim rotating, then
    ``rotary_dim`` (the metadata's), then the dims before an unchanging tail."""
    if not moved or min(moved) < 1:
        raise ValueError("fit_convention needs keys at positive offsets, the smallest ideally 1")
    if max(relative_error(base, k) for k in moved.values()) <= tolerance:
        return RopeConvention("none", (), None, None, 0.0, "fitted", tolerance)  # keys ignore position
    head_dim = base.shape[-1]
    tail = unrotated_tail(base, moved, tolerance)
    candidates = dict.fromkeys(d // 2 * 2 for d in (head_dim, rotary_dim or head_dim, head_dim - tail) if d >= 2)
    best: tuple[float, RopeStyle, np.ndarray] | None = None
    for dims in candidates:
        for style in ROTATING_STYLES:
            omega = _fit_style(base, moved, style, dims)
            error = rotation_error(base, moved, style, omega)
            if best is None or error < best[0]:
                best = (error, style, omega)
        if best is not None and best[0] <= tolerance:
            break
    assert best is not None
    error, style, omega = best
    if error > tolerance:
        logger.warning("no RoPE rotation explains the model's keys (best fit error %.2e, tolerance %.2e)",
                       error, tolerance)
        return None
    params = _parametric(omega, len(omega) * 2)
    if params is not None:
        # NOTE: the closed form is exact where the measurement is noisy (low frequencies, u8 KV).
        meta = RopeMetadata(*params)
        for rounding in ROUNDINGS:
            exact = meta.frequencies(layer=0, rotary_dim=len(omega) * 2, rounding=rounding)
            exact_error = rotation_error(base, moved, style, exact)
            if exact_error <= tolerance:
                return RopeConvention(style, tuple(float(w) for w in exact), params[0], params[1], exact_error,
                                      "fitted", tolerance, rounding=rounding)
    return RopeConvention(style, tuple(float(w) for w in omega), None, None, error, "fitted", tolerance)


def rotation_error(base: np.ndarray, moved: Mapping[int, np.ndarray], style: RopeStyle, inv_freq: np.ndarray) -> float:
    """Worst relative error of rotating ``base`` onto ``moved[p]`` by p positions, over every p."""
    return max(relative_error(rotate_pairs(base, style, inv_freq, p), k) for p, k in moved.items())


def convention_from_metadata(
    metadata: RopeMetadata, base: np.ndarray, moved: Mapping[int, np.ndarray], *, tolerance: float,
    num_layers: int = 1,
) -> RopeConvention | None:
    """The metadata's RoPE — exact or fp16-rounded frequencies, in whichever pairing explains layer
    0's keys (``base`` / ``moved[p]`` ``[..., T, dim]``) best — for ``num_layers`` layers; None when
    none does within ``tolerance``."""
    rotary_dim = metadata.rotary_dim(base.shape[-1])
    errors: dict[tuple[Rounding, RopeStyle], float] = {}
    for rounding in ROUNDINGS:
        inv_freq = metadata.frequencies(layer=0, rotary_dim=rotary_dim, rounding=rounding)
        for style in ROTATING_STYLES:
            errors[rounding, style] = rotation_error(base, moved, style, inv_freq)
    rounding, style = min(errors, key=errors.__getitem__)
    if errors[rounding, style] > tolerance:
        logger.warning("the model's metadata RoPE (%s) does not explain its keys (error %.2e, tolerance %.2e); "
                       "fitting instead", metadata, errors[rounding, style], tolerance)
        return None

    def freq(layer: int) -> tuple[float, ...]:
        return tuple(float(w) for w in metadata.frequencies(layer=layer, rotary_dim=rotary_dim, rounding=rounding))

    per_layer = metadata.per_layer and num_layers > 1
    global_layer = next((i for i in range(num_layers) if i not in metadata.local_layers), 0) if per_layer else 0
    return RopeConvention(
        style, freq(global_layer), metadata.theta, metadata.scale, errors[rounding, style],
        "metadata", tolerance, rounding=rounding,
        layer_inv_freq=tuple(freq(i) for i in range(num_layers)) if per_layer else (),
        layer_theta=tuple(metadata.layer_theta(i) for i in range(num_layers)) if per_layer else ())


def prefill_at_offset(slot: ProbeSlot, ids: Sequence[int], offset: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Empty ``slot``, prefill ``ids`` at positions ``offset..offset+T-1``; return float32
    K, V ``[layers, 1, heads, T, dim]`` and the last position's logits ``[vocab]``. Blocking;
    the slot keeps that KV (a test helper too: ``prefill_at_offset(slot, ids, 100)``)."""
    slot.reset()
    logits = slot.feed(np.array([list(ids)], dtype=np.int64), past_len=0, position_offset=offset)
    keys, values = slot.read()
    return keys, values, logits[0]
