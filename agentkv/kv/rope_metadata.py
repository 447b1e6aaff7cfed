"""RoPE as the model's metadata states it: θ, scaling, rotated dims and per-layer θ from config.json or GGUF.

``rope_metadata`` reads what ``kv/rope.py`` then verifies on the model's keys; ``frequencies``
gives each layer's radians per position of each pair, exactly or rounded to fp16 as
optimum-intel's fp16 export stores its ``inv_freq``::

    meta = rope_metadata(json.loads(Path("config.json").read_text(encoding="utf-8")), {})
    meta.frequencies(layer=0, rotary_dim=12)          # float64 [6]
    meta.frequencies(layer=0, rotary_dim=12, rounding="fp16")

Read: ``rope_theta`` (or GPT-NeoX ``rotary_emb_base``), ``rope_scaling`` linear and ``llama3``
(Llama 3.1), ``partial_rotary_factor`` (Phi-3, Phi-4-mini) or ``rotary_pct`` (GPT-NeoX), Gemma 3's
``rope_local_base_freq`` on its sliding layers (``layer_types`` or ``sliding_window_pattern``), a
``text_config`` wrapper; GGUF ``*.rope.freq_base`` / ``*.rope.scaling.*`` /
``*.rope.dimension_count``. Other scalings (yarn, longrope, dynamic) give None: the fit decides.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

Rounding = Literal["exact", "fp16"]
ROUNDINGS: tuple[Rounding, ...] = ("exact", "fp16")
"""How stored inverse frequencies may be rounded (optimum-intel's fp16 export keeps them in fp16)."""
GEMMA3_GGUF_LOCAL_THETA = 10000.0
"""llama.cpp's Gemma 3 θ on sliding layers (its GGUF states only the global θ)."""
GEMMA3_GGUF_PATTERN = 6
"""llama.cpp's Gemma 3 layer pattern: every 6th layer global, the rest sliding."""


@dataclass(frozen=True)
class Llama3Scaling:
    """Llama 3.1's ``rope_scaling`` (``rope_type: llama3``): long wavelengths divided by ``factor``,
    short ones kept, a smooth blend between: ``Llama3Scaling(8, 1, 4, 8192).apply(inv_freq)``."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def apply(self, inv_freq: np.ndarray) -> np.ndarray:
        """The scaled frequencies (float64, same shape)."""
        context = float(self.original_max_position_embeddings)
        wavelength = 2 * math.pi / inv_freq
        low_wavelength = context / self.low_freq_factor   # longer than this: fully scaled
        high_wavelength = context / self.high_freq_factor  # shorter than this: unscaled
        blend = (context / wavelength - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
        smoothed = (1 - blend) * inv_freq / self.factor + blend * inv_freq
        scaled = np.where(wavelength > low_wavelength, inv_freq / self.factor, inv_freq)
        medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
        return np.asarray(np.where(medium, smoothed, scaled), dtype=np.float64)


@dataclass(frozen=True)
class RopeMetadata:
    """What config.json / GGUF say of the rotary embedding (verified later on the keys)."""

    theta: float
    """Base θ (the global layers' when layers differ)."""
    scale: float = 1.0
    """Linear position-scaling factor (1.0: none)."""
    llama3: Llama3Scaling | None = None
    """Llama 3.1 frequency scaling, applied after ``scale``."""
    rotary_fraction: float = 1.0
    """Share of each head's dims that rotate (Phi-3 ``partial_rotary_factor`` 0.75)."""
    rotary_dims: int | None = None
    """Number of rotated dims when stated absolutely (GGUF ``rope.dimension_count``); wins over the fraction."""
    local_theta: float | None = None
    """θ of the sliding-window layers when it differs (Gemma 3 ``rope_local_base_freq``; unscaled)."""
    local_layers: tuple[int, ...] = ()
    """Which layers use ``local_theta``."""

    def rotary_dim(self, head_dim: int) -> int:
        """How many of ``head_dim`` dims rotate (even):
        ``RopeMetadata(1e4, rotary_fraction=0.75).rotary_dim(16) == 12``."""
        dims = self.rotary_dims if self.rotary_dims is not None else int(head_dim * self.rotary_fraction)
        return max(0, min(head_dim, dims)) // 2 * 2

    @property
    def per_layer(self) -> bool:
        """True when some layers use another θ."""
        return self.local_theta is not None and bool(self.local_layers)

    def layer_theta(self, layer: int) -> float:
        """θ of ``layer``."""
        if self.local_theta is not None and layer in self.local_layers:
            return self.local_theta
        return self.theta

    def frequencies(self, *, layer: int, rotary_dim: int, rounding: Rounding = "exact") -> np.ndarray:
        """Radians per position of each of ``layer``'s ``rotary_dim / 2`` pairs, float64 (``"fp16"``:
        computed in float32 and stored in float16, as an fp16 IR holds them)."""
        local = self.local_theta is not None and layer in self.local_layers
        theta = self.layer_theta(layer)
        inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
        if not local:
            inv_freq = inv_freq / self.scale
            if self.llama3 is not None:
                inv_freq = self.llama3.apply(inv_freq)
        if rounding == "fp16":
            inv_freq = inv_freq.astype(np.float32).astype(np.float16).astype(np.float64)
        return np.asarray(inv_freq)


def rope_metadata(config: Mapping[str, Any], gguf: Mapping[str, Any]) -> RopeMetadata | None:
    """The RoPE config.json or GGUF metadata states; None when neither states θ or the scaling is
    one the fit must find (``rope_metadata({"rope_theta": 1e4}, {}) == RopeMetadata(1e4)``)."""
    text: Mapping[str, Any] = config.get("text_config") or config
    if text.get("rope_theta") is not None or text.get("rotary_emb_base") is not None:
        return _from_config(text)
    if isinstance(text.get("rope_parameters"), Mapping):
        return _from_rope_parameters(text)
    return _from_gguf(gguf)


def _from_config(config: Mapping[str, Any]) -> RopeMetadata | None:
    theta = float(config.get("rope_theta") or config["rotary_emb_base"])
    scaled = _scaling(config.get("rope_scaling"))
    if scaled is None:
        return None
    scale, llama3 = scaled
    fraction = float(config.get("partial_rotary_factor") or config.get("rotary_pct") or 1.0)
    local = config.get("rope_local_base_freq")
    return RopeMetadata(theta, scale, llama3, fraction,
                        local_theta=None if local is None else float(local),
                        local_layers=_sliding_layers(config) if local is not None else ())


def _from_rope_parameters(config: Mapping[str, Any]) -> RopeMetadata | None:
    """transformers 5's ``rope_parameters``: one dict, or one per layer type."""
    params: Mapping[str, Any] = config["rope_parameters"]
    fraction = float(config.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 1.0)
    if "full_attention" in params:
        glob, local = params["full_attention"], params.get("sliding_attention")
        scaled = _scaling(glob)
        if scaled is None or glob.get("rope_theta") is None:
            return None
        local_theta = None if not local else float(local["rope_theta"])
        return RopeMetadata(float(glob["rope_theta"]), *scaled, fraction, local_theta=local_theta,
                            local_layers=_sliding_layers(config) if local_theta is not None else ())
    scaled = _scaling(params)
    if scaled is None or params.get("rope_theta") is None:
        return None
    return RopeMetadata(float(params["rope_theta"]), *scaled, fraction)


def _scaling(scaling: Any) -> tuple[float, Llama3Scaling | None] | None:
    """(linear factor, llama3 scaling) of a ``rope_scaling`` dict; None for kinds the fit must find."""
    if not scaling:
        return 1.0, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default", "none"):
        return 1.0, None
    if kind == "linear" and scaling.get("factor"):
        return float(scaling["factor"]), None
    if kind == "llama3":
        return 1.0, Llama3Scaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                  float(scaling["high_freq_factor"]),
                                  int(scaling["original_max_position_embeddings"]))
    return None  # yarn, longrope, dynamic…: the fit finds the frequencies


def _sliding_layers(config: Mapping[str, Any]) -> tuple[int, ...]:
    """Indices of sliding-window layers: ``layer_types``, else every ``sliding_window_pattern``-th
    layer global (Gemma 3: 6)."""
    types = config.get("layer_types")
    if types:
        return tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
    pattern = int(config.get("sliding_window_pattern") or 0)
    layers = int(config.get("num_hidden_layers") or 0)
    return tuple(i for i in range(layers) if pattern and (i + 1) % pattern)


def _from_gguf(gguf: Mapping[str, Any]) -> RopeMetadata | None:
    def key(suffix: str) -> Any:
        return next((v for k, v in gguf.items() if k.endswith(suffix)), None)

    theta = key(".rope.freq_base")
    if theta is None:
        return None
    kind, factor = key(".rope.scaling.type"), key(".rope.scaling.factor")
    if kind not in (None, "none") and (kind != "linear" or not factor):
        return None
    dims = key(".rope.dimension_count")
    scale = float(factor) if kind == "linear" else 1.0
    if gguf.get("general.architecture") == "gemma3":
        layers = int(key(".block_count") or 0)
        local = tuple(i for i in range(layers) if (i + 1) % GEMMA3_GGUF_PATTERN)
        return RopeMetadata(float(theta), scale, rotary_dims=None if dims is None else int(dims),
                            local_theta=GEMMA3_GGUF_LOCAL_THETA, local_layers=local)
    return RopeMetadata(float(theta), scale, rotary_dims=None if dims is None else int(dims))
