"""KV snapshots cut along the token axis and joined back, bit for bit, cuts re-based
(``kv/snapshot_cuts.py``): the fields of the snapshot ``KVSnapshot.span`` and ``KVSnapshot.join``
build::

    head = KVSnapshot(**span_fields(snap, 0, 64))
    whole = KVSnapshot(**joined_fields([head, KVSnapshot(**span_fields(snap, 64, snap.num_tokens))]))

Float and u8 snapshots are cut at any token (u8's per-token scale and zero arrays with them);
raw u8 paged blocks only at block bounds: a block's parameters cover all its tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from agentkv.errors import UserError
from agentkv.kv.snapshot_cuts import Cuts, join_cuts, span_cuts
from agentkv.kv.snapshot_layout import QUANT_PARAMS, RAW_BLOCKS, SnapshotArrays

Fields = dict[str, Any]
"""Keyword arguments of ``KVSnapshot``."""


def span_fields(snap: SnapshotArrays, start: int, stop: int) -> Fields:
    """Tokens ``start:stop`` of ``snap``, arrays copied; the cuts count from ``start`` and hold 0
    when a pass began at ``start``. Raw u8 blocks: ``start`` and ``stop`` multiples of
    ``block_tokens`` (``stop`` may be ``num_tokens``): ``KVSnapshot(**span_fields(snap, 32, 64))``."""
    if not 0 <= start <= stop <= snap.num_tokens:
        raise UserError(f"span({start}, {stop}) is outside the snapshot's {snap.num_tokens} tokens; "
                        f"pass 0 <= start <= stop <= {snap.num_tokens}")
    if snap.precision == RAW_BLOCKS:
        assert snap.block_tokens is not None
        if start % snap.block_tokens or (stop % snap.block_tokens and stop != snap.num_tokens):
            raise UserError(f"raw u8 blocks are cut at block bounds: span({start}, {stop}) needs start and "
                            f"stop multiples of {snap.block_tokens} (stop may be {snap.num_tokens})")
    return sliced_fields(snap, start, stop, span_cuts(snap.cuts, start, stop), copy=True)


def sliced_fields(snap: SnapshotArrays, start: int, stop: int, cuts: Cuts, *, copy: bool) -> Fields:
    """Tokens ``start:stop`` of ``snap`` with ``cuts``: views, or copies owning their memory
    (raw blocks: the blocks holding them): ``KVSnapshot(**sliced_fields(snap, 0, 16, (4,), copy=False))``."""
    def take(array: np.ndarray, axis: int, begin: int, end: int) -> np.ndarray:
        index: list[slice] = [slice(None)] * array.ndim
        index[axis] = slice(begin, end)
        piece = array[tuple(index)]
        return piece.copy() if copy else piece

    tokens = snap.tokens[start:stop]
    if snap.precision == RAW_BLOCKS:
        assert snap.block_tokens is not None
        first, last = start // snap.block_tokens, -(-stop // snap.block_tokens)
        return dict(tokens=tokens, keys=take(snap.keys, 1, first, last), values=take(snap.values, 1, first, last),
                    precision=RAW_BLOCKS, fingerprint=snap.fingerprint, shifted=snap.shifted,
                    lossless=snap.lossless, block_tokens=snap.block_tokens, cuts=cuts)
    params: dict[str, Any] = {name: None if getattr(snap, name) is None else take(getattr(snap, name), 3, start, stop)
                              for name in QUANT_PARAMS}
    return dict(tokens=tokens, keys=take(snap.keys, 3, start, stop), values=take(snap.values, 3, start, stop),
                precision=snap.precision, fingerprint=snap.fingerprint, shifted=snap.shifted,
                lossless=snap.lossless, cuts=cuts, **params)


def joined_fields(parts: Sequence[SnapshotArrays]) -> Fields:
    """Consecutive spans as one snapshot (``KVSnapshot(**joined_fields([head, tail]))``): shifted
    if any part is, lossless only if every part is; the parts share fingerprint, precision and
    layout (raw blocks: all but the last hold whole blocks)."""
    if not parts:
        raise UserError("join needs at least one snapshot; pass the spans in token order")
    first = parts[0]
    for part in parts[1:]:
        _check_joinable(first, part)
    if first.precision == RAW_BLOCKS:
        assert first.block_tokens is not None
        if any(p.num_tokens % first.block_tokens for p in parts[:-1]):
            raise UserError(f"raw u8 blocks join at block bounds: every part but the last must hold a "
                            f"multiple of {first.block_tokens} tokens, got {[p.num_tokens for p in parts]}")
    axis = _token_axis(first)

    def joined(name: str) -> Any:
        arrays = [getattr(p, name) for p in parts]
        return None if arrays[0] is None else np.concatenate(arrays, axis=axis)

    return dict(tokens=tuple(t for p in parts for t in p.tokens), keys=joined("keys"), values=joined("values"),
                precision=first.precision, fingerprint=first.fingerprint,
                shifted=any(p.shifted for p in parts), lossless=all(p.lossless for p in parts),
                block_tokens=first.block_tokens, cuts=join_cuts([(p.cuts, p.num_tokens) for p in parts]),
                **{name: joined(name) for name in QUANT_PARAMS})


def _token_axis(snap: SnapshotArrays) -> int:
    """The array axis spans are cut along: blocks for raw u8 blocks, else tokens."""
    return 1 if snap.precision == RAW_BLOCKS else 3


def _check_joinable(first: SnapshotArrays, part: SnapshotArrays) -> None:
    """``UserError`` unless ``part`` can follow ``first`` in a join (same model, precision, layout)."""
    if (part.fingerprint, part.precision, part.block_tokens) != (first.fingerprint, first.precision,
                                                                 first.block_tokens):
        raise UserError(f"join takes spans of one snapshot kind: ({first.fingerprint!r}, {first.precision}, "
                        f"block_tokens={first.block_tokens}) and ({part.fingerprint!r}, {part.precision}, "
                        f"block_tokens={part.block_tokens}) differ; join spans of the same model and precision")
    axis = _token_axis(first)
    for name in ("keys", "values", *QUANT_PARAMS):
        a, b = getattr(first, name), getattr(part, name)
        if a is None or b is None:
            continue
        if a.dtype != b.dtype or a.shape[:axis] != b.shape[:axis] or a.shape[axis + 1:] != b.shape[axis + 1:]:
            raise UserError(f"join takes spans of one layout: {name} {a.shape} {a.dtype} and {b.shape} {b.dtype} "
                            "differ beyond the token axis; join spans of the same engine")
