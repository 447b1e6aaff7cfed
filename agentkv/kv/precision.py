"""How KV values are stored: u8 quantisation with per-vector scale and zero, bfloat16 as bits,
and which storage forms give float32 values back bit for bit.

Pure numpy, shared by snapshots, the prefix cache and the paged engine's blocks::

    q, scale, zero = quantize_u8(keys)                   # keys ≈ q * scale + zero
    bits = to_bf16_bits(keys); back = from_bf16_bits(bits)
    lossless_precision(keys, values)                     # "bf16", "f16" or "f32"
"""

from __future__ import annotations

from typing import Literal

import numpy as np

Precision = Literal["f32", "bf16", "f16", "u8"]
"""How a snapshot stores K/V: float32, bfloat16 (as the upper 16 bits of float32), float16, or
u8 with per-vector scale and zero."""
PrecisionChoice = Literal["auto", "f32", "bf16", "f16", "u8"]
"""What a caller may ask for: a storage precision, or "auto" (smallest lossless form)."""
_U8_LEVELS = 255.0


def quantize_u8(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric min/max quantisation over the last axis: ``x ≈ q * scale + zero``.

    ``x``: float ``[..., head_dim]`` → ``q`` uint8 ``[..., head_dim]``, ``scale`` and ``zero``
    float32 ``[...]``. The error is at most ``scale / 2`` per element (plus float rounding).
    """
    x = np.asarray(x, dtype=np.float32)
    lo = x.min(axis=-1)  # [...]
    hi = x.max(axis=-1)
    scale = (hi - lo) / np.float32(_U8_LEVELS)
    # NOTE: a constant vector has range 0; any non-zero scale then gives q = 0 and exact values.
    scale = np.where(scale > 0, scale, np.float32(1.0)).astype(np.float32)
    q = np.rint((x - lo[..., None]) / scale[..., None])
    q = np.clip(q, 0, _U8_LEVELS).astype(np.uint8)
    return q, scale, lo.astype(np.float32)


def dequantize_u8(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Inverse of ``quantize_u8``: float32 ``q * scale + zero`` (scale, zero broadcast on the last axis)."""
    scale32 = scale.astype(np.float32)[..., None]
    zero32 = zero.astype(np.float32)[..., None]
    return q.astype(np.float32) * scale32 + zero32


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """bfloat16 storage of float32 ``x``: its upper 16 bits (truncation; exact for bf16 values)."""
    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 storage made by ``to_bf16_bits``."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


_SAMPLE = 4096
"""Values checked first: most KV that does not fit a precision shows it in its first few (the
whole array is checked only when they fit)."""


def holds_exactly(precision: Precision, *arrays: np.ndarray) -> bool:
    """True when storing float32 ``arrays`` in ``precision`` gives back every value bit for bit."""
    if precision == "f32":
        return True
    if precision not in ("bf16", "f16"):
        return False
    as_f32 = [np.ascontiguousarray(a, dtype=np.float32).reshape(-1) for a in arrays]
    return (all(_fits(precision, a[:_SAMPLE]) for a in as_f32)  # NOTE: fails fast on a sample (a 2K-token
            and all(_fits(precision, a) for a in as_f32))      # f16 KV is 46 MB: a full pass costs ~0.1 s)


def _fits(precision: Precision, values: np.ndarray) -> bool:
    if precision == "bf16":
        return not np.any(values.view(np.uint32) & np.uint32(0xFFFF))
    with np.errstate(over="ignore"):
        return bool(np.array_equal(values.astype(np.float16).astype(np.float32), values))


def lossless_precision(*arrays: np.ndarray) -> Precision:
    """The smallest storage that holds every float32 value of ``arrays`` exactly:
    ``lossless_precision(np.float32([0.5, 2.0])) == "bf16"``."""
    return next(p for p in ("bf16", "f16", "f32") if holds_exactly(p, *arrays))
