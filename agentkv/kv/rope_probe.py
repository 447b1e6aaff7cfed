"""Measuring a model's RoPE on a KV slot: keys prefilled at several offsets, the machine's noise, the verdict.

The engine's backend runs it once per model (``await engine.rope_convention()``); the rotation
maths and the fit are ``kv/rope.py``, what the metadata says is ``kv/rope_metadata.py``::

    convention = measure_convention(slot, tokenizer.encode(PROBE_TEXT), floor=1e-3,
                                    metadata=rope_metadata(config, {}))
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import numpy as np

from agentkv.kv.rope import (
    ProbeSlot,
    RopeConvention,
    relative_error,
    convention_from_metadata,
    fit_convention,
    prefill_at_offset,
    rotation_error,
)
from agentkv.kv.rope_metadata import RopeMetadata

logger = logging.getLogger(__name__)

PROBE_TEXT = "The quick brown fox jumps over the lazy dog while the river keeps flowing to the sea."
PROBE_OFFSETS = (1, 16, 256, 2048)
"""Offsets measured: 1 gives every frequency without wrap-around, larger ones refine it."""
NOISE_FACTOR = 3.0
"""The tolerance is at least this many times the chunking noise measured on the probe
(measured: fit error / noise 1.0–1.6 with dynamic quantisation and bf16 compute on)."""
DEPTH_MARGIN = 0.5
"""Every layer's keys must fit the rotation with at most this fraction of the unrotated error
(measured: ≤0.04 rotated vs ~1 unrotated with bf16 compute; a layer without RoPE gives ≫1)."""


def measure_keys(slot: ProbeSlot, ids: Sequence[int], offsets: Sequence[int]) -> dict[int, np.ndarray]:
    """Keys ``[layers, batch, heads, T, dim]`` of ``ids`` prefilled at each offset (0 included).

    Blocking; empties the slot afterwards. Raises ``UserError`` for models without
    ``position_ids``."""
    try:
        return {offset: prefill_at_offset(slot, ids, offset)[0] for offset in (0, *offsets)}
    finally:
        slot.reset()


def chunking_noise(
    slot: ProbeSlot, ids: Sequence[int], offsets: Sequence[int], keys: Mapping[int, np.ndarray]
) -> float:
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
            worst = max(worst, relative_error(slot.read()[0], keys[offset]))
    finally:
        slot.reset()
    return worst


def measure_convention(
    slot: ProbeSlot, ids: Sequence[int], *, floor: float, metadata: RopeMetadata | tuple[float, float] | None
) -> RopeConvention | None:
    """Measure the slot's RoPE: keys at ``PROBE_OFFSETS`` and the machine's noise; the metadata
    (a ``RopeMetadata``, or (θ, linear scale)) verified (or a fit) on layer 0 — whose keys pass
    through no attention, so only rounding separates them from an exact rotation — against
    ``max(floor, NOISE_FACTOR × noise)``; then every layer must be explained by its own
    frequencies far better than by none (a layer without RoPE, or another rotation, makes the
    convention unusable for span drops). Blocking."""
    if isinstance(metadata, tuple):
        metadata = RopeMetadata(*metadata)
    keys = measure_keys(slot, ids, PROBE_OFFSETS)
    noise = chunking_noise(slot, ids, (0, max(PROBE_OFFSETS)), keys)
    tolerance = max(floor, NOISE_FACTOR * noise)
    base = keys.pop(0)
    first = {p: k[:1] for p, k in keys.items()}
    convention = None
    if metadata is not None:
        convention = convention_from_metadata(metadata, base[:1], first, tolerance=tolerance, num_layers=base.shape[0])
    if convention is None:
        rotary_dim = None if metadata is None else metadata.rotary_dim(base.shape[-1])
        convention = fit_convention(base[:1], first, tolerance=tolerance, rotary_dim=rotary_dim)
    if convention is None or convention.style == "none":
        return convention
    errors = layer_errors(convention, base, keys)
    worst = next(((layer, r, u) for layer, (r, u) in enumerate(errors) if r > DEPTH_MARGIN * u), None)
    if worst is not None:
        logger.warning("RoPE θ=%s does not explain layer %d of the model's keys (rotated error %.2e vs %.2e "
                       "unrotated); span drops are unavailable", convention.for_layer(worst[0]).theta, *worst)
        return None
    logger.info("RoPE (%s, %s frequencies): %s over %d dims, θ=%s%s, scale=%s, layer-0 error %.1e within %.1e "
                "(noise %.1e), deeper layers ≤ %.1e", convention.source, convention.rounding or "measured",
                convention.style, convention.rotary_dim, convention.theta,
                f" (per layer {sorted(set(convention.layer_theta))})" if convention.layer_theta else "",
                convention.scale, convention.fit_error, tolerance, noise, max(r for r, _ in errors))
    return convention


def layer_errors(
    convention: RopeConvention, base: np.ndarray, moved: Mapping[int, np.ndarray]
) -> list[tuple[float, float]]:
    """Per layer of ``base`` ``[layers, ..., T, dim]``: (error rotating it by its own frequencies,
    error of no rotation) onto ``moved[p]``, both relative to the largest key."""
    errors = []
    for layer in range(base.shape[0]):
        own = convention.for_layer(layer)
        layer_moved = {p: k[layer] for p, k in moved.items()}
        rotated = rotation_error(base[layer], layer_moved, own.style, np.asarray(own.inv_freq))
        unrotated = max(relative_error(base[layer], k) for k in layer_moved.values())
        errors.append((rotated, unrotated))
    return errors
