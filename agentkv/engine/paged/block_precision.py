"""The element type the paged engine's KV blocks get: what was asked, but f16 is bf16 under bf16 compute.

::

    block_precision("f16", ov.Core(), "CPU", {})    # "bf16" on a CPU computing in bf16 (AMX), else "f16"
    default_block_precision("CPU")                  # the paged engine's KV precision when none is asked
"""

from __future__ import annotations

import openvino as ov

from agentkv.engine.openvino.engine import DEFAULT_KV_PRECISION
from agentkv.engine.paged.graphs import compute_precision


def block_precision(asked: str, core: ov.Core, device: str, config: dict[str, str]) -> str:
    """The blocks' element type for ``asked`` ("f16", "f32" or "u8") compiled with ``config``:
    ``block_precision("f32", ov.Core(), "CPU", {}) == "f32"``."""
    # NOTE: with bf16 compute the plugin writes bf16 into a 16-bit cache whatever it is called:
    # type it bf16, or reading it as f16 gives garbage (measured: keys off by ~100 %).
    if asked == "f16" and compute_precision(core, device, config) == "bf16":
        return "bf16"
    return asked


def default_block_precision(device: str = "CPU") -> str:
    """The KV precision a ``PagedEngine`` given no ``kv_cache_precision`` uses on this machine's
    ``device`` (``DEFAULT_KV_PRECISION``, typed bf16 under bf16 compute): ``"f16"`` on an avx2 CPU."""
    return block_precision(DEFAULT_KV_PRECISION, ov.Core(), device, {"KV_CACHE_PRECISION": DEFAULT_KV_PRECISION})
