"""Block files: one keyed block of a token log's KV as bytes, checked against its key when read back.

A block is the KV of ``block_size`` tokens of a log, cut out of a ``KVSnapshot`` at a multiple of
the block size (``KVSnapshot.span``). Its bytes are a safetensors file — the arrays of that span
(tokens, K, V, u8 scales, cuts) and one metadata entry, ``agentkv.kv_block``, holding a JSON
header: the block's key, its parent's key, its log position, the absolute cuts inside it, the
storage precision and a checksum over header and arrays::

    data = encode_block(snap.span(32, 64), key=chain.keys[1], parent=chain.keys[0], start=32,
                        cuts=snap.cuts)
    span = decode_block(data, key=chain.keys[1], parent=chain.keys[0], start=32, namespace=space)

``decode_block`` verifies everything a reader cannot take on trust from a tier shared by processes,
hosts and tenants: the bytes are whole (``BlockCorrupt`` for truncated or damaged ones) and they
are the block asked for — its tokens and cuts, under the asked parent, give the asked key in
``namespace`` (else ``BlockForeign``: another tenant's, model's or log's block under that name).
The storage precision travels with each block (``precision="auto"`` snapshots choose the lossless
form per snapshot), so blocks of one log may differ in it; ``join_blocks`` brings them to one.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as load_tensors
from safetensors.numpy import save as save_tensors

from agentkv.errors import SnapshotCorrupt, UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.digest import content_checksum
from agentkv.kv.snapshot import KVSnapshot

__all__ = ["BLOCK_HEADER_KEY", "BlockCorrupt", "BlockForeign", "decode_block", "encode_block", "join_blocks"]

BLOCK_HEADER_KEY = "agentkv.kv_block"
"""The safetensors metadata key of a block's JSON header."""
_FORMAT = "agentkv.kv_block/1"
_QUANT = ("key_scale", "key_zero", "value_scale", "value_zero")
_LENGTH = struct.Struct("<Q")
_MAX_HEADER_BYTES = 1 << 20


class BlockCorrupt(SnapshotCorrupt):
    """A stored block's bytes are damaged or cut short: the store skips it and re-prefills."""


class BlockForeign(BlockCorrupt):
    """A stored block is not the one its key names (another log, model or tenant under that name)."""


def encode_block(span: KVSnapshot, *, key: str, parent: str, start: int, cuts: Sequence[int] | None) -> bytes:
    """The bytes of one block: ``span`` (the KV of tokens ``start..start + len``) under ``key``,
    whose parent block is ``parent``; ``cuts`` are the log's absolute cuts (those inside the block
    are kept). ``encode_block(snap.span(0, 32), key=k0, parent=space.id, start=0, cuts=snap.cuts)``"""
    if span.shifted:
        raise UserError("a shifted KV (a RoPE span drop) is not stored as keyed blocks: save it whole")
    stop = start + span.num_tokens
    inside = [int(c) for c in (cuts or ()) if start <= c < stop]
    arrays = _arrays(span)
    header = {"format": _FORMAT, "key": key, "parent": parent, "start": int(start), "cuts": inside,
              "precision": span.precision, "fingerprint": span.fingerprint, "lossless": span.lossless,
              "block_tokens": span.block_tokens}
    header["checksum"] = content_checksum(header, arrays.values())
    contiguous = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    return bytes(save_tensors(contiguous, metadata={BLOCK_HEADER_KEY: json.dumps(header, sort_keys=True)}))


def decode_block(data: bytes, *, key: str, parent: str, start: int, namespace: KVNamespace) -> KVSnapshot:
    """The span a block's bytes hold, after checking they are whole and are the block ``key``
    names (``BlockCorrupt`` / ``BlockForeign`` otherwise). Its cuts are the block's own (log
    positions re-based to the block's start, as ``KVSnapshot.span`` gives them)."""
    header = _header(data, key)
    try:
        arrays = load_tensors(data)
    except (SafetensorError, ValueError) as error:
        raise BlockCorrupt(f"KV block {key} is cut short or damaged ({error}); it will be re-prefilled") from error
    stated = {name: value for name, value in header.items() if name != "checksum"}
    if content_checksum(stated, (arrays[name] for name in _order(arrays))) != header.get("checksum"):
        raise BlockCorrupt(f"KV block {key} fails its checksum; it will be re-prefilled")
    if header.get("key") != key or header.get("parent") != parent or header.get("start") != start:
        raise BlockForeign(f"the object stored as KV block {key} is block {header.get('key')} at position "
                           f"{header.get('start')}; skipped (it will be re-prefilled)")
    tokens = arrays.get("tokens")
    if tokens is None or len(tokens) != namespace.block_size:
        raise BlockForeign(f"KV block {key} holds {0 if tokens is None else len(tokens)} tokens, not "
                           f"{namespace.block_size}; skipped")
    try:
        derived = namespace.key_of(parent, start, tokens, header["cuts"])
    except UserError as error:
        raise BlockForeign(f"KV block {key} has a header that names no block ({error}); skipped") from error
    if derived != key:
        raise BlockForeign(f"KV block {key} holds other tokens or another tenant's or model's KV; skipped")
    try:
        return KVSnapshot(
            tokens=tuple(int(t) for t in tokens), keys=arrays["keys"], values=arrays["values"],
            precision=header["precision"], fingerprint=str(header["fingerprint"]), lossless=bool(header["lossless"]),
            block_tokens=header.get("block_tokens"), cuts=_relative(header["cuts"], start),
            key_scale=arrays.get("key_scale"), key_zero=arrays.get("key_zero"),
            value_scale=arrays.get("value_scale"), value_zero=arrays.get("value_zero"),
        )
    except (KeyError, TypeError, UserError) as error:
        raise BlockCorrupt(f"KV block {key} has an inconsistent layout ({error}); it will be re-prefilled") from error


def join_blocks(parts: Sequence[KVSnapshot]) -> KVSnapshot:
    """One snapshot of consecutive spans (blocks, then maybe a tail), in log order. Spans stored in
    different lossless precisions are brought to one first (the same values: no rounding)::

        snap = join_blocks([decode_block(...), decode_block(...), tail])"""
    if not parts:
        raise UserError("join_blocks needs at least one span")
    if len({p.precision for p in parts}) > 1:
        parts = [_as_float(p) for p in parts]
    return KVSnapshot.join(list(parts))


def _as_float(span: KVSnapshot) -> KVSnapshot:
    """``span`` in f32 storage (its exact values when it is lossless)."""
    if span.precision == "f32":
        return span
    if span.precision in ("u8", "u8-paged"):
        raise UserError(f"spans in {span.precision} join only with spans of the same precision")
    keys, values = span.to_float()
    return KVSnapshot.from_float(span.tokens, keys, values, precision="f32", fingerprint=span.fingerprint,
                                 lossless=span.lossless, cuts=span.cuts)


def _arrays(span: KVSnapshot) -> dict[str, np.ndarray]:
    """The span's arrays in a fixed order (the checksum's)."""
    arrays: dict[str, np.ndarray] = {"tokens": np.asarray(span.tokens, dtype="<i8"), "keys": span.keys,
                                     "values": span.values}
    for name in _QUANT:
        value = getattr(span, name)
        if value is not None:
            arrays[name] = value
    return arrays


def _order(arrays: dict[str, np.ndarray]) -> list[str]:
    """``_arrays``' order for arrays read back (safetensors sorts them by name)."""
    return [name for name in ("tokens", "keys", "values", *_QUANT) if name in arrays]


def _relative(cuts: Any, start: int) -> tuple[int, ...]:
    """The block's cuts as ``KVSnapshot.span`` keeps them: offsets from the block's first token."""
    return tuple(int(c) - start for c in cuts)


def _header(data: bytes, key: str) -> dict[str, Any]:
    """The block's JSON header (``BlockCorrupt`` when there is none to read)."""
    if len(data) < _LENGTH.size:
        raise BlockCorrupt(f"KV block {key} is cut short ({len(data)} bytes); it will be re-prefilled")
    (length,) = _LENGTH.unpack_from(data)
    if length > _MAX_HEADER_BYTES or len(data) < _LENGTH.size + length:
        raise BlockCorrupt(f"KV block {key} is cut short or not a block; it will be re-prefilled")
    try:
        outer = json.loads(data[_LENGTH.size:_LENGTH.size + length])
        header = json.loads(outer["__metadata__"][BLOCK_HEADER_KEY])
    except (ValueError, KeyError, TypeError) as error:
        raise BlockCorrupt(f"KV block {key} has no agentkv block header ({error}); it will be re-prefilled") from error
    if not isinstance(header, dict) or header.get("format") != _FORMAT:
        raise BlockCorrupt(f"KV block {key} is not in a block format this agentkv reads; it will be re-prefilled")
    return header
