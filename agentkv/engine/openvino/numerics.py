"""The CPU plugin's numerics as compiled on this machine, the exact mode, and which KV paths are bit-exact.

Machines differ: on a CPU with avx512 the plugin quantises activations dynamically
(``DYNAMIC_QUANTIZATION_GROUP_SIZE`` 32), and with avx512_bf16/AMX it also computes in bfloat16
(``INFERENCE_PRECISION_HINT``). Either makes a prefill's logits depend on how it was chunked
(up to ~1 max abs logit on the default model). ``exact=True`` turns both off and keeps an f32
KV cache: chunking then changes logits by ~5e-5 only, on any CPU::

    engine = StatefulEngine(exact=True)            # f32 KV, f32 compute, no dynamic quantisation
    engine.numerics                                 # PluginNumerics(kv_cache='f32', inference='f32', ...)

What is bit-identical on the stateful engine whatever the numerics (the tests assert these
with ``==``), and what is only close:

- **bit-identical**: restoring KV that was read out of a slot — host offload, disk
  snapshots, prefix-cache entries, fork — when the cache is f32, f16 or bf16 (the state API
  takes those values back unchanged; snapshots store them losslessly, see ``KVSnapshot``);
  a prefix-cache hit vs a cold prefill, because every registered prefix boundary is a chunk
  boundary on both paths (``kv/chunking.py``); trim + prefill vs the same chunks fed again.
- **close, not equal**: a u8 KV cache restored through the state API (the plugin quantises
  the dequantised values again: ~2e-6 drift, then next-token logits move by up to ~0.7);
  decode-by-token vs a re-prefill of the same generated text; any two different chunkings
  (a resumed history that re-prefills instead of restoring); a RoPE-shifted session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

EXACT_CONFIG: dict[str, str] = {
    "KV_CACHE_PRECISION": "f32",
    "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0",
    "INFERENCE_PRECISION_HINT": "f32",
}
"""Plugin settings of ``exact=True``: numerics that do not depend on chunking (CPU)."""

RESTORABLE_KV = frozenset({"f32", "f16", "bf16"})
"""KV cache precisions whose values the state API takes back bit for bit."""


def precision_name(value: Any) -> str:
    """A plugin element type as a short name: ``precision_name("<Type: 'uint8_t'>") == "u8"``."""
    text = str(value).lower()
    for name, spelled in (("bf16", "bfloat16"), ("f16", "float16"), ("f32", "float32"), ("u8", "uint8"),
                          ("u4", "uint4"), ("i8", "int8")):
        if spelled in text or f"'{name}'" in text or text == name:
            return name
    return text


@dataclass(frozen=True)
class PluginNumerics:
    """What the compiled model computes in, read back from the plugin (not what was asked)."""

    kv_cache: str
    """KV cache element type: "u8", "f16", "bf16" or "f32"."""
    inference: str
    """Compute precision of the plugin (``INFERENCE_PRECISION_HINT``): "f32", "bf16" or "f16"."""
    dynamic_quantization_group_size: int
    """Activation dynamic-quantisation group size; 0 = off."""

    @classmethod
    def of(cls, compiled: Any, requested_kv: str | None = None) -> PluginNumerics:
        """Read from an ``ov.CompiledModel``; properties a device lacks read as the request or f32."""
        return cls(
            kv_cache=_property(compiled, "KV_CACHE_PRECISION", requested_kv or "f32"),
            inference=_property(compiled, "INFERENCE_PRECISION_HINT", "f32"),
            dynamic_quantization_group_size=int(_property(compiled, "DYNAMIC_QUANTIZATION_GROUP_SIZE", "0")),
        )

    @property
    def exact(self) -> bool:
        """True when a prefill's logits do not depend on its chunking beyond float rounding."""
        return self.kv_cache == "f32" and self.inference == "f32" and self.dynamic_quantization_group_size == 0

    @property
    def restores_exact(self) -> bool:
        """True when KV read from a slot and written back is bit-identical (not a u8 cache)."""
        return self.kv_cache in RESTORABLE_KV

    def __str__(self) -> str:
        return (f"kv={self.kv_cache} compute={self.inference} "
                f"dynamic_quantization={self.dynamic_quantization_group_size or 'off'}")


def _property(compiled: Any, name: str, default: str) -> str:
    try:
        value = compiled.get_property(name)
    except RuntimeError:
        return default
    return str(value) if name == "DYNAMIC_QUANTIZATION_GROUP_SIZE" else precision_name(value)
