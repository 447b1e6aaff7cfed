"""What a KV snapshot's arrays look like in each storage precision, and the check that they do.

``KVSnapshot`` calls ``check_layout`` when it is built: float and u8 snapshots hold
``[layers, batch, heads, T, head_dim]`` in their precision's dtype (u8 with per-token scale and
zero arrays), raw u8 paged blocks ``[layers, blocks, heads, rows, cols]`` with the parameters
inside the blocks (``kv/u8_blocks.py``)::

    check_layout(snapshot)        # UserError naming what does not fit
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import numpy as np

from agentkv.errors import UserError
from agentkv.kv.u8_blocks import raw_block_layouts

STORAGE_DTYPES: dict[str, np.dtype[Any]] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),
    "f16": np.dtype("<f2"),
    "u8": np.dtype("u1"),
    "u8-paged": np.dtype("u1"),
}
"""The dtype each storage precision keeps its keys and values in."""
RAW_BLOCKS: Final = "u8-paged"
"""The storage precision of raw u8 paged blocks (parameters inside the blocks)."""
_PARAM_DTYPES = (np.dtype("<f4"), np.dtype("<f2"))
QUANT_PARAMS = ("key_scale", "key_zero", "value_scale", "value_zero")
"""The ``KVSnapshot`` fields holding u8 quantisation parameters (all None unless the precision is u8)."""


class SnapshotArrays(Protocol):
    """What the layout check and ``kv/snapshot_spans.py`` read of a ``KVSnapshot``."""

    @property
    def tokens(self) -> tuple[int, ...]: ...
    @property
    def keys(self) -> np.ndarray: ...
    @property
    def values(self) -> np.ndarray: ...
    @property
    def precision(self) -> str: ...
    @property
    def fingerprint(self) -> str: ...
    @property
    def shifted(self) -> bool: ...
    @property
    def lossless(self) -> bool: ...
    @property
    def block_tokens(self) -> int | None: ...
    @property
    def cuts(self) -> tuple[int, ...] | None: ...
    @property
    def num_tokens(self) -> int: ...


def check_layout(snap: SnapshotArrays) -> None:
    """``UserError`` unless ``snap``'s arrays fit its precision and tokens: ``check_layout(snapshot)``."""
    if snap.precision not in STORAGE_DTYPES:
        raise UserError(f"precision must be one of f32, bf16, f16, u8, u8-paged, not {snap.precision!r}")
    if snap.precision == RAW_BLOCKS:
        _check_blocks(snap)
        return
    if snap.block_tokens is not None:
        raise UserError("block_tokens belongs to u8-paged snapshots only")
    dtype = STORAGE_DTYPES[snap.precision]
    if snap.keys.ndim != 5 or snap.keys.shape != snap.values.shape:
        raise UserError(
            "keys and values must share one shape [layers, batch, heads, T, head_dim]; got "
            f"{snap.keys.shape} and {snap.values.shape}"
        )
    if snap.keys.dtype != dtype or snap.values.dtype != dtype:
        raise UserError(
            f"precision {snap.precision} stores {dtype}, got {snap.keys.dtype}/{snap.values.dtype}; "
            "build snapshots with KVSnapshot.from_float"
        )
    if snap.keys.shape[3] != len(snap.tokens):
        raise UserError(f"KV holds {snap.keys.shape[3]} tokens but the log has {len(snap.tokens)}")
    params = [getattr(snap, name) for name in QUANT_PARAMS]
    if snap.precision != "u8":
        if any(p is not None for p in params):
            raise UserError("scale/zero arrays belong to u8 snapshots only")
        return
    for name, p in zip(QUANT_PARAMS, params):
        if p is None or p.shape != snap.keys.shape[:4] or p.dtype not in _PARAM_DTYPES:
            got = None if p is None else (p.shape, str(p.dtype))
            raise UserError(
                f"u8 snapshot needs {name} of shape {snap.keys.shape[:4]} in float32/float16, "
                f"got {got}"
            )


def _check_blocks(snap: SnapshotArrays) -> None:
    if snap.block_tokens is None or snap.block_tokens < 1:
        raise UserError("a u8-paged snapshot needs block_tokens >= 1")
    # raises on blocks of another dtype, count or an unknown layout
    raw_block_layouts(snap.keys, snap.values, num_tokens=len(snap.tokens), block_tokens=snap.block_tokens)
    if any(getattr(snap, name) is not None for name in QUANT_PARAMS):
        raise UserError("scale/zero arrays belong to u8 snapshots only")
