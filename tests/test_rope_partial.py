"""RoPE beyond one θ over the whole head (issue 25 item 8), numpy only: partial rotary (Phi-3's
``partial_rotary_factor``), per-layer θ (Gemma 3's sliding layers), fp16-rounded inverse
frequencies (optimum-intel's fp16 export) and llama3 scaling — rotation, span drop, fit,
verification against metadata, and the metadata read from config.json / GGUF.

The real-model counterpart, every zoo family: ``tests/model/test_zoo_rope_model.py``."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.kv.rope import (
    RopeConvention,
    RopeMetadata,
    convention_from_metadata,
    drop_span,
    fit_convention,
    rope_metadata,
    rotate_pairs,
)
from agentkv.kv.rope_metadata import Llama3Scaling

OFFSETS = (1, 16, 256, 2048)


def rotated(raw: np.ndarray, style: str, inv_freq: np.ndarray, offset: int) -> np.ndarray:
    """``raw`` ``[..., T, dim]`` with token t rotated to position ``offset + t``."""
    tokens = [rotate_pairs(raw[..., t, :], style, inv_freq, float(offset + t)) for t in range(raw.shape[-2])]
    return np.stack(tokens, axis=-2)


def raw_keys(seed: int = 0, layers: int = 1, dim: int = 16) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((layers, 1, 2, 10, dim)).astype(np.float32)


def rotate_half_reference(x: np.ndarray, inv_freq: np.ndarray, position: float) -> np.ndarray:
    """HF's partial rotary, written out: rotate-half over the first 2·len(inv_freq) dims, rest kept."""
    rot, rest = x[..., : 2 * len(inv_freq)], x[..., 2 * len(inv_freq):]
    angle = np.concatenate([inv_freq, inv_freq]) * position
    half = len(inv_freq)
    rotated_half = np.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return np.concatenate([rot * np.cos(angle) + rotated_half * np.sin(angle), rest], axis=-1)


# ---- partial rotary --------------------------------------------------------------------------


def test_partial_rotary_rotates_the_first_rotary_dims_as_rotate_half_and_keeps_the_rest():
    inv_freq = RopeMetadata(1e4, rotary_fraction=0.75).frequencies(layer=0, rotary_dim=12)
    keys = raw_keys()
    convention = RopeConvention("rotate_half", tuple(inv_freq), 1e4, 1.0, 0.0)
    assert convention.rotary_dim == 12
    moved = convention.rotate(keys, 37)
    assert np.allclose(moved, rotate_half_reference(keys, inv_freq, 37.0), atol=1e-5)
    assert np.array_equal(moved[..., 12:], keys[..., 12:])
    assert np.allclose(convention.rotate(moved, -37), keys, atol=1e-5)


def test_partial_interleaved_rotary_pairs_neighbours_within_the_rotary_dims():
    inv_freq = RopeMetadata(1e4).frequencies(layer=0, rotary_dim=8)
    convention = RopeConvention("interleaved", tuple(inv_freq), 1e4, 1.0, 0.0)
    keys = raw_keys()
    moved = convention.rotate(keys, 5)
    assert np.array_equal(moved[..., 8:], keys[..., 8:])
    angle = 5 * convention.inv_freq[1]
    a, b = keys[..., 2], keys[..., 3]
    assert np.allclose(moved[..., 2], a * np.cos(angle) - b * np.sin(angle), atol=1e-5)


def test_partial_rotary_span_drop_equals_the_kept_tokens_at_their_new_positions():
    inv_freq = RopeMetadata(1e4).frequencies(layer=0, rotary_dim=12)
    raw = raw_keys()
    keys = rotated(raw, "rotate_half", inv_freq, 0)
    convention = RopeConvention("rotate_half", tuple(inv_freq), 1e4, 1.0, 0.0)
    values = np.arange(keys.size, dtype=np.float32).reshape(keys.shape)
    kept, kept_values = drop_span(keys, values, 2, 6, convention)
    fresh = rotated(np.concatenate([raw[..., :2, :], raw[..., 6:, :]], axis=-2), "rotate_half", inv_freq, 0)
    assert np.allclose(kept, fresh, atol=1e-5)
    assert np.array_equal(kept_values, np.concatenate([values[..., :2, :], values[..., 6:, :]], axis=-2))


@pytest.mark.parametrize("hint", [None, 12])
def test_fit_finds_partial_rotary_with_or_without_the_configs_rotary_dim(hint):
    inv_freq = RopeMetadata(1e4).frequencies(layer=0, rotary_dim=12)
    raw = raw_keys(1)
    base = rotated(raw, "rotate_half", inv_freq, 0)
    moved = {p: rotated(raw, "rotate_half", inv_freq, p) for p in OFFSETS}
    convention = fit_convention(base, moved, rotary_dim=hint)
    assert convention is not None
    assert (convention.style, convention.rotary_dim) == ("rotate_half", 12)
    assert convention.theta == pytest.approx(1e4, rel=1e-3)
    assert convention.fit_error < 1e-4


# ---- per-layer θ ----------------------------------------------------------------------------


def gemma3_like() -> tuple[RopeMetadata, np.ndarray, dict[int, np.ndarray]]:
    """Three layers: 0 and 1 sliding (θ 1e4), 2 global (θ 1e6); keys at offset 0 and each offset."""
    meta = RopeMetadata(1e6, local_theta=1e4, local_layers=(0, 1))
    raw = raw_keys(2, layers=3)

    def at(offset: int) -> np.ndarray:
        return np.stack([rotated(raw[i], "rotate_half", meta.frequencies(layer=i, rotary_dim=16), offset)
                         for i in range(3)])

    return meta, at(0), {p: at(p) for p in OFFSETS}


def test_per_layer_convention_rotates_and_drops_each_layer_by_its_own_theta():
    meta, base, moved = gemma3_like()
    convention = convention_from_metadata(meta, base[:1], {p: k[:1] for p, k in moved.items()},
                                          tolerance=1e-4, num_layers=3)
    assert convention is not None and convention.source == "metadata"
    assert convention.layer_theta == (1e4, 1e4, 1e6) and convention.theta == 1e6
    assert convention.for_layer(0).theta == 1e4 and convention.for_layer(2).theta == 1e6
    assert convention.for_layer(2).inv_freq == convention.inv_freq  # the global layers'
    assert np.allclose(convention.rotate(moved[256], -256), base, atol=1e-4)
    for layer in range(3):
        assert np.allclose(convention.for_layer(layer).rotate(moved[16][layer], -16), base[layer], atol=1e-4)
    values = np.zeros_like(base)
    kept, _ = drop_span(base, values, 1, 4, convention)
    for layer in range(3):
        single, _ = drop_span(base[layer], values[layer], 1, 4, convention.for_layer(layer))
        assert np.array_equal(kept[layer], single)


def test_a_single_theta_convention_would_not_explain_the_global_layer():
    meta, base, moved = gemma3_like()
    local = RopeMetadata(1e4).frequencies(layer=0, rotary_dim=16)
    error = np.max(np.abs(rotate_pairs(moved[2048][2], "rotate_half", local, -2048.0) - base[2]))
    assert error > 0.1


def test_per_layer_convention_refuses_keys_without_a_layer_axis():
    meta, base, moved = gemma3_like()
    convention = convention_from_metadata(meta, base[:1], {p: k[:1] for p, k in moved.items()},
                                          tolerance=1e-4, num_layers=3)
    assert convention is not None
    with pytest.raises(ValueError, match="for_layer"):
        convention.rotate(base[:2], 5)


# ---- fp16-rounded frequencies ---------------------------------------------------------------


@pytest.mark.parametrize("rounding", ["exact", "fp16"])
def test_metadata_verifies_with_exact_or_fp16_rounded_frequencies_and_keeps_those_used(rounding):
    meta = RopeMetadata(1e6)
    stored = meta.frequencies(layer=0, rotary_dim=16, rounding=rounding)
    raw = raw_keys(3)
    base = rotated(raw, "rotate_half", stored, 0)
    moved = {p: rotated(raw, "rotate_half", stored, p) for p in OFFSETS}
    convention = convention_from_metadata(meta, base, moved, tolerance=1e-4)
    assert convention is not None
    assert (convention.source, convention.theta, convention.rounding) == ("metadata", 1e6, rounding)
    assert np.array_equal(np.asarray(convention.inv_freq), stored)
    assert convention.fit_error < 1e-5


def test_fp16_rounding_is_visible_at_large_offsets():
    """Why it matters: at p = 2048 the rounding moves keys by ~5e-2 of their size (the zoo measured
    4.9e-2 on Qwen2.5), far above an f32 cache's 1e-3 tolerance."""
    meta = RopeMetadata(1e6)
    exact, rounded = (meta.frequencies(layer=0, rotary_dim=16, rounding=r) for r in ("exact", "fp16"))
    assert np.max(np.abs(exact - rounded) * 2048) > 1e-2


# ---- metadata from config.json / GGUF -------------------------------------------------------


def test_phi3_config_gives_partial_rotary_and_longrope_is_left_to_the_fit():
    phi3 = {"model_type": "phi3", "hidden_size": 3072, "num_attention_heads": 32, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75, "rope_scaling": None}
    meta = rope_metadata(phi3, {})
    assert meta == RopeMetadata(10000.0, rotary_fraction=0.75)
    assert meta.rotary_dim(96) == 72 and meta.rotary_dim(16) == 12
    assert len(meta.frequencies(layer=0, rotary_dim=12)) == 6
    phi4_mini = {**phi3, "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 48, "short_factor": [1.0] * 48}}
    assert rope_metadata(phi4_mini, {}) is None
    neox = {"rotary_emb_base": 10000, "rotary_pct": 0.25}
    assert rope_metadata(neox, {}) == RopeMetadata(10000.0, rotary_fraction=0.25)


@pytest.mark.parametrize("layout", [
    {"layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2},
    {"sliding_window_pattern": 6, "num_hidden_layers": 8},
])
def test_gemma3_config_gives_local_theta_on_sliding_layers_and_scaling_on_global_ones(layout):
    gemma3 = {"model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, **layout}
    meta = rope_metadata({"text_config": gemma3, "model_type": "gemma3"}, {})
    assert meta is not None and meta.per_layer
    assert meta.local_layers == (0, 1, 2, 3, 4, 6, 7)
    assert [meta.layer_theta(i) for i in (0, 5)] == [1e4, 1e6]
    assert meta.frequencies(layer=0, rotary_dim=16)[0] == 1.0  # local layers are unscaled
    assert meta.frequencies(layer=5, rotary_dim=16)[0] == pytest.approx(1 / 8)


def test_llama31_config_gives_llama3_scaled_frequencies():
    llama = {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    meta = rope_metadata(llama, {})
    assert meta is not None and meta.llama3 == Llama3Scaling(8.0, 1.0, 4.0, 8192)
    plain = RopeMetadata(5e5).frequencies(layer=0, rotary_dim=128)
    scaled = meta.frequencies(layer=0, rotary_dim=128)
    wavelength = 2 * np.pi / plain
    short, long = wavelength < 8192 / 4, wavelength > 8192 / 1
    assert np.array_equal(scaled[short], plain[short])
    assert np.allclose(scaled[long], plain[long] / 8)
    medium = ~short & ~long
    assert medium.any() and np.all((scaled[medium] < plain[medium]) & (scaled[medium] > plain[medium] / 8))


def test_qwen2_config_and_transformers5_rope_parameters():
    qwen2 = {"model_type": "qwen2", "rope_theta": 1e6, "rope_scaling": None, "sliding_window": 32768,
             "layer_types": ["full_attention"] * 4}
    assert rope_metadata(qwen2, {}) == RopeMetadata(1e6)
    assert rope_metadata({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, {}) == RopeMetadata(1e6)
    per_type = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                "layer_types": ["sliding_attention", "full_attention"]}
    assert rope_metadata(per_type, {}) == RopeMetadata(1e6, local_theta=1e4, local_layers=(0,))


def test_gguf_metadata_gives_rotary_dims_and_gemma3_local_theta():
    phi2 = {"general.architecture": "phi2", "phi2.rope.freq_base": 1e4, "phi2.rope.dimension_count": 32}
    assert rope_metadata({}, phi2) == RopeMetadata(1e4, rotary_dims=32)
    assert RopeMetadata(1e4, rotary_dims=32).rotary_dim(80) == 32
    gemma3 = {"general.architecture": "gemma3", "gemma3.rope.freq_base": 1e6, "gemma3.block_count": 12}
    meta = rope_metadata({}, gemma3)
    assert meta is not None and meta.local_layers == (0, 1, 2, 3, 4, 6, 7, 8, 9, 10)
    assert meta.layer_theta(5) == 1e6 and meta.layer_theta(0) == 1e4
