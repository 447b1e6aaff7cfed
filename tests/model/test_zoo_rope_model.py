"""RoPE on every zoo family (issue 25 item 8): the convention comes from config.json and is verified
on the model's own keys — Phi-3.5's partial rotary (12 of 16 dims), Gemma 3's per-layer θ (1e4 on
sliding layers, 1e6 on the global one), Llama 3.1's llama3 scaling, every family's fp16-rounded
inverse frequencies (optimum-intel's fp16 export) — and a span drop then equals a fresh prefill.

Measured (exact numerics, f32 KV, this machine): every family verifies as metadata with fp16
frequencies, layer-0 fit error 9e-8 (Llama 3.1, Phi-3.5) to 1.8e-7 (Qwen2.5), deeper layers
≤ 1.1e-6 (Gemma 3); without the fp16 rounding the same θ misses by 5e-2 to 1.7 and used to fall
back to a fit (θ unreported) or, for Phi-3.5 and Gemma 3, to no convention at all. Next-token
logits after a shift (offset 1000 rotated back, 40-token drop, tail drop) stay within 9.5e-7 to
2.6e-6 of a fresh prefill; ``LOGIT_TOL`` is the f32 KV's 1e-3 (DESIGN.md).

Sliding-window layers (Gemma 2, Gemma 3: window 32) hold every position's KV and mask by
distance, so after a drop the window covers the last 32 *kept* positions — what a fresh prefill
of the kept tokens sees. Decision: drops are allowed anywhere, also spans longer than the window
and spans that lie beyond it; the drop test below removes 40 tokens (> 32), with 50 kept tokens
after them, so the sliding layers' windows (by distance) change across the cut.

The exact span-drop test builds a KV whose kept tokens never attended the dropped span: the span
at positions 0..39, the kept tokens prefilled alone at 40..89; ``KVLog.drop`` (what
``KVSession.drop`` runs) must then give exactly a fresh prefill of the kept tokens, on every layer,
up to the rotation's rounding. Kept tokens that did attend a dropped span are close to, not equal
to, a fresh prefill (their distances to earlier tokens changed too), so a span in the middle has
no exact test (DESIGN.md; its closeness: ``tests/model/test_rope_shift_model.py``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from zoo_helpers import exact_zoo_engine

from agentkv.kv.log import KVLog
from agentkv.kv.rope import prefill_at_offset, rope_metadata

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "config.json").is_file()) if ZOO.is_dir() else []
TEXT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
        "movable metal type, oil-based ink and a screw press adapted from wine making. Before that, books "
        "in Europe were copied by hand, usually in monasteries, and a single Bible could take a scribe more "
        "than a year. Within fifty years of Gutenberg's first prints, presses were operating in many cities.")
LOGIT_TOL = 1e-3
"""f32 KV, exact numerics: the KV's precision tolerance (DESIGN.md: chunked vs one-pass 4e-5)."""


def _engine(family: str) -> Any:
    """One engine per family (exact numerics, no prefix cache), shared with test_zoo_model."""
    return exact_zoo_engine(family)


def _config(family: str) -> dict[str, Any]:
    return dict(json.loads((ZOO / family / "config.json").read_text(encoding="utf-8")))


def _ids(engine: Any, n: int) -> list[int]:
    ids = [int(t) for t in engine.tokenizer.encode(TEXT)]
    assert len(ids) >= n, len(ids)
    return ids[:n]


@pytest.mark.parametrize("family", FAMILIES)
async def test_rope_comes_from_the_config_and_is_verified_on_the_keys(family: str) -> None:
    engine, config = _engine(family), _config(family)
    convention = await engine.rope_convention()
    assert convention is not None, family
    assert (convention.source, convention.style) == ("metadata", "rotate_half")
    assert convention.theta == config["rope_theta"]
    assert convention.rounding == "fp16"  # optimum-intel's fp16 export stores inv_freq in fp16
    assert convention.fit_error <= convention.tolerance
    head_dim = config["head_dim"]
    assert convention.rotary_dim == int(head_dim * config.get("partial_rotary_factor", 1.0))
    meta = rope_metadata(config, {})
    assert meta is not None
    assert convention.inv_freq == tuple(meta.frequencies(layer=config["layer_types"].index("full_attention")
                                                         if meta.per_layer else 0,
                                                         rotary_dim=convention.rotary_dim, rounding="fp16"))
    if "rope_local_base_freq" in config:
        expected = tuple(config["rope_local_base_freq"] if kind == "sliding_attention" else config["rope_theta"]
                         for kind in config["layer_types"])
        assert convention.layer_theta == expected
        assert len(convention.layer_inv_freq) == config["num_hidden_layers"]
    else:
        assert convention.layer_inv_freq == ()


def test_the_zoo_covers_partial_rotary_per_layer_theta_and_llama3_scaling() -> None:
    phi, gemma3, llama = (rope_metadata(_config(f), {}) for f in ("phi3_5", "gemma3", "llama3_1"))
    assert phi is not None and phi.rotary_fraction == 0.75
    assert gemma3 is not None and gemma3.per_layer
    assert llama is not None and llama.llama3 is not None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("offset", [40, 1000])
async def test_a_prefill_at_offset_p_rotated_back_equals_a_prefill_at_zero(family: str, offset: int) -> None:
    engine = _engine(family)
    convention = await engine.rope_convention()
    assert convention is not None
    ids = _ids(engine, 48)
    follow = np.array([[ids[5]]], dtype=np.int64)
    holder = await engine.open_session()
    try:
        async with engine.pool.lease(holder) as slot:
            keys0, _, _ = prefill_at_offset(slot, ids, 0)
            next0 = slot.feed(follow, past_len=len(ids))[0]
            keys_p, values_p, _ = prefill_at_offset(slot, ids, offset)
            shifted = convention.rotate(keys_p, -offset)
            slot.reset()
            slot.write(shifted, values_p)
            next_shifted = slot.feed(follow, past_len=len(ids))[0]
    finally:
        await holder.close()
    scale = float(np.abs(keys0).max())
    for layer in range(keys0.shape[0]):  # every layer by its own θ (Gemma 3: 1e4 and 1e6)
        assert np.max(np.abs(shifted[layer] - keys0[layer])) <= 1e-4 * scale, f"{family} layer {layer}"
    assert np.max(np.abs(next_shifted - next0)) <= LOGIT_TOL


@pytest.mark.parametrize("family", FAMILIES)
async def test_dropping_a_span_longer_than_the_window_equals_a_fresh_prefill_of_the_kept_tokens(family: str) -> None:
    engine = _engine(family)
    convention = await engine.rope_convention()
    assert convention is not None
    ids = _ids(engine, 90)
    span, kept = ids[:40], ids[40:90]  # 40 dropped tokens (window 32), 50 kept after them
    follow = np.array([[ids[7]]], dtype=np.int64)
    holder = await engine.open_session()
    try:
        async with engine.pool.lease(holder) as slot:
            slot.reset()
            slot.feed(np.array([kept]), past_len=0)
            fresh = slot.feed(follow, past_len=len(kept))[0]
            keys_s, values_s, _ = prefill_at_offset(slot, span, 0)
            keys_k, values_k, _ = prefill_at_offset(slot, kept, len(span))  # never attended the span
            slot.reset()
            slot.write(np.concatenate([keys_s, keys_k], axis=-2), np.concatenate([values_s, values_k], axis=-2))
            log = KVLog()
            log.tokens = [*span, *kept]
            log.drop(slot, 0, len(span), convention)  # what KVSession.drop runs
            assert log.tokens == kept and log.shifted
            dropped = slot.feed(follow, past_len=len(kept))[0]
    finally:
        await holder.close()
    assert np.max(np.abs(dropped - fresh)) <= LOGIT_TOL, family


@pytest.mark.parametrize("family", FAMILIES)
async def test_session_drop_of_the_tail_equals_a_fresh_prefill_of_the_rest(family: str) -> None:
    engine = _engine(family)
    ids = _ids(engine, 70)
    session, fresh = await engine.open_session(), await engine.open_session()
    try:
        await session.prefill(ids)
        await session.drop(30, 70)
        await fresh.prefill(ids[:30])
        assert session.tokens == tuple(ids[:30]) and session.shifted
        gap = np.max(np.abs(await session.next_token_logits() - await fresh.next_token_logits()))
    finally:
        await session.close()
        await fresh.close()
    assert gap <= LOGIT_TOL, family
