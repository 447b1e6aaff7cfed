"""The CPU-plugin behaviours the exactness tests run under, whatever this machine's CPU is.

Machines differ: a CPU without avx512 computes in f32 with no dynamic quantisation; one with
avx512 quantises activations (group 32); one with avx512_bf16/AMX also computes in bf16. Each
profile asks the plugin for one behaviour; a profile this CPU ignores is skipped, saying why::

    engine = numerics_engine("dq32", num_slots=1)
"""

from __future__ import annotations

from typing import Any

import pytest

PROFILES: dict[str, dict[str, str]] = {
    "this-cpu": {},
    "dq32": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32", "INFERENCE_PRECISION_HINT": "f32"},
    "dq0": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", "INFERENCE_PRECISION_HINT": "f32"},
}
"""this-cpu: the plugin's defaults here; dq32: an avx512 CPU without bf16 (dynamic quantisation
on); dq0: a CPU without avx512 (f32, no dynamic quantisation)."""


def numerics_engine(profile: str, **options: Any):
    """A ``StatefulEngine`` with the profile's plugin settings; skips when the CPU ignores them."""
    from agentkv.engine.stateful.engine import StatefulEngine

    config = PROFILES[profile]
    engine = StatefulEngine(ov_config=dict(config), **options)
    wanted = config.get("DYNAMIC_QUANTIZATION_GROUP_SIZE")
    got = engine.numerics.dynamic_quantization_group_size
    if wanted is not None and int(wanted) != got:
        pytest.skip(f"this CPU ignores DYNAMIC_QUANTIZATION_GROUP_SIZE={wanted} (the plugin reports {got})")
    return engine
