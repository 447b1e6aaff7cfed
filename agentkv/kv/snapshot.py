"""KV snapshots as plain numpy arrays: quantise, slice and checksum the KV of a token log.

The engine reads each layer's K and V state as float32 ``[batch, heads, T, head_dim]``,
stacks them on a layer axis and hands them here; nothing in this module knows OpenVINO::

    snap = KVSnapshot.from_float(tokens, keys, values, precision="u8", fingerprint=fp)
    snap.to_file(path)
    keys, values = KVSnapshot.from_file(path, expected_fingerprint=fp).to_float()

Files are safetensors (``kv.snapshot_file`` reads and writes them, older files too); their
header carries the snapshot's ``checksum()``, which covers the metadata and every array byte.

Exactness: ``precision="auto"`` stores the smallest form that gives back the very float32
values it was made from — bf16 (the upper half of each float32) when every value is a
bfloat16, else f16 when every value is a float16, else f32 — so ``to_float()`` returns the
input bit for bit (``snap.lossless`` is True). An explicit ``"f16"`` or ``"u8"`` may round;
``lossless`` then says whether it did.

A u8 paged cache is snapshotted as its raw blocks (``precision="u8-paged"``, built with
``KVSnapshot.from_blocks``): the only copy of it that restores bit for bit, at u8 size.

A snapshot carries ``cuts``, where the passes that computed its KV began (``kv/log.py``,
``kv/snapshot_cuts.py``): written as an int64 array ``cuts`` when known; a file written before
them reads back with ``cuts=None`` (unknown) and its checksum still verifies. ``span`` cuts the
KV of some tokens out as a snapshot of its own and ``join`` glues spans back, bit for bit::

    head, tail = snap.span(0, 64), snap.span(64, snap.num_tokens)
    whole = KVSnapshot.join([head, tail])      # tokens, arrays and cuts equal snap's
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np

from agentkv.errors import SnapshotIncompatible, UserError
from agentkv.kv.digest import content_checksum
from agentkv.kv.precision import (
    Precision,
    PrecisionChoice,
    dequantize_u8,
    from_bf16_bits,
    holds_exactly,
    lossless_precision,
    quantize_u8,
    to_bf16_bits,
)
from agentkv.kv.snapshot_cuts import checked_cuts, prefix_cuts
from agentkv.kv.snapshot_file import (
    SnapshotPayload,
    corrupt,
    read_payload,
    write_payload,
)
from agentkv.kv.snapshot_layout import QUANT_PARAMS, RAW_BLOCKS, STORAGE_DTYPES, check_layout
from agentkv.kv.snapshot_spans import joined_fields, sliced_fields, span_fields
from agentkv.kv.u8_blocks import BlockLayout, raw_block_layouts

__all__ = ["QUANT_PARAMS", "RAW_BLOCKS", "SUFFIX", "KVSnapshot", "Precision", "PrecisionChoice", "dequantize_u8",
           "from_bf16_bits", "holds_exactly", "lossless_precision", "quantize_u8", "to_bf16_bits"]

SUFFIX = ".agkv"
"""The file suffix of every KV snapshot file (the store's, and the engine's spill files)."""

def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (the caller's array keeps its own flags)."""
    view = a.view()
    view.setflags(write=False)
    return view


class WritableSlot(Protocol):
    """Where a snapshot is written: float32 K/V, or the 16-bit form a slot with a
    ``stored_precision`` attribute keeps (f16 values, bf16 bits as uint16)."""

    def write(self, keys: np.ndarray, values: np.ndarray) -> None: ...


@dataclass(frozen=True, eq=False)
class KVSnapshot:
    """The KV of a token log, detached from any model request. Arrays are read-only views.

    Build one with ``KVSnapshot.from_float``; read it back as float32 with ``to_float()``.
    """

    tokens: tuple[int, ...]
    """The token log whose KV this is (positions 0..len-1)."""
    keys: np.ndarray
    """``[layers, batch, heads, T, head_dim]`` in the storage dtype of ``precision`` (raw blocks:
    ``[layers, blocks, heads, rows, cols]``)."""
    values: np.ndarray
    """Same shape and dtype as ``keys`` (raw blocks: same leading axes, the value block's shape)."""
    precision: Precision | Literal["u8-paged"]
    """Storage precision: "f32", "bf16", "f16", "u8" (u8 carries per-token affine params) or
    "u8-paged" (a u8 paged cache's raw blocks)."""
    fingerprint: str
    """Model + KV layout identity; a snapshot is only restored where the fingerprint matches."""
    shifted: bool = False
    """The KV had a span dropped by a RoPE shift: close to, not equal to, a fresh prefill."""
    lossless: bool = True
    """``to_float()`` gives back exactly the float32 values the snapshot was made from (False
    when a lossy precision rounded them, or the KV was already inexact when captured)."""
    key_scale: np.ndarray | None = None
    """u8 only: ``[layers, batch, heads, T]`` scale of the keys (float32 or float16)."""
    key_zero: np.ndarray | None = None
    """u8 only: ``[layers, batch, heads, T]`` offset of the keys (the per-vector minimum)."""
    value_scale: np.ndarray | None = None
    """u8 only: like ``key_scale``, for the values."""
    value_zero: np.ndarray | None = None
    """u8 only: like ``key_zero``, for the values."""
    block_tokens: int | None = None
    """u8-paged only: tokens per block."""
    cuts: tuple[int, ...] | None = None
    """Where the passes that computed this KV began, counted from the first token: sorted, unique,
    in ``[0, num_tokens)``. A whole log's snapshot never holds 0 (implied); a ``span``'s holds 0
    when a pass began at its first token. None: unknown (a file written before cuts existed)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        object.__setattr__(self, "cuts", checked_cuts(self.cuts, len(self.tokens)))
        check_layout(self)
        for name in ("keys", "values", *QUANT_PARAMS):
            array = getattr(self, name)
            if array is not None:
                object.__setattr__(self, name, _read_only(array))

    def _layouts(self) -> tuple[BlockLayout, BlockLayout]:
        assert self.block_tokens is not None
        return raw_block_layouts(self.keys, self.values, num_tokens=self.num_tokens, block_tokens=self.block_tokens)

    @classmethod
    def from_blocks(cls, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, *, block_tokens: int,
                    fingerprint: str, shifted: bool = False, lossless: bool = True,
                    cuts: Sequence[int] | None = None) -> KVSnapshot:
        """A u8 paged cache's raw blocks ``[layers, blocks, heads, rows, cols]`` (as
        ``PagedSlot.read_blocks`` gives them) holding ``tokens``; restores bit for bit::

            snap = KVSnapshot.from_blocks(tokens, *slot.read_blocks(), block_tokens=32, fingerprint=fp,
                                          cuts=log.cuts)
        """
        if np.asarray(keys).dtype != np.uint8 or np.asarray(values).dtype != np.uint8:
            raise UserError("from_blocks takes a u8 cache's raw blocks (uint8); snapshot float caches with from_float")
        return cls(tokens=tuple(tokens), keys=np.array(keys), values=np.array(values),
                   precision=RAW_BLOCKS, fingerprint=fingerprint, shifted=shifted, lossless=lossless,
                   block_tokens=block_tokens, cuts=None if cuts is None else tuple(cuts))

    @classmethod
    def from_float(
        cls,
        tokens: Sequence[int],
        keys_f32: np.ndarray,
        values_f32: np.ndarray,
        *,
        precision: PrecisionChoice = "auto",
        fingerprint: str,
        shifted: bool = False,
        lossless: bool = True,
        cuts: Sequence[int] | None = None,
    ) -> KVSnapshot:
        """Store float K/V ``[layers, batch, heads, T, head_dim]`` in ``precision`` ("auto": the
        smallest lossless form). ``lossless=False`` marks KV that was inexact before capture;
        ``cuts``: where the passes that computed it began (``log.cuts``; None: unknown).

        The result owns copies: later writes to ``keys_f32`` do not change the snapshot.
        """
        keys = np.asarray(keys_f32, dtype=np.float32)
        values = np.asarray(values_f32, dtype=np.float32)
        stored: Precision = lossless_precision(keys, values) if precision == "auto" else precision
        known_cuts = None if cuts is None else tuple(cuts)
        if stored == "u8":
            kq, ks, kz = quantize_u8(keys)
            vq, vs, vz = quantize_u8(values)
            return cls(tokens=tuple(tokens), keys=kq, values=vq, precision=stored, fingerprint=fingerprint,
                       shifted=shifted, lossless=False, key_scale=ks, key_zero=kz, value_scale=vs, value_zero=vz,
                       cuts=known_cuts)
        if stored not in STORAGE_DTYPES:
            raise UserError(f"precision must be one of auto, f32, bf16, f16, u8, not {stored!r}")
        if stored == "bf16":
            stored_k, stored_v = to_bf16_bits(keys), to_bf16_bits(values)
        else:
            dtype = STORAGE_DTYPES[stored]
            stored_k, stored_v = keys.astype(dtype, copy=True), values.astype(dtype, copy=True)
        # NOTE: "auto" chose a precision that holds them exactly: no second pass over the KV
        exact = lossless and (precision == "auto" or holds_exactly(stored, keys, values))
        return cls(tokens=tuple(tokens), keys=stored_k, values=stored_v, precision=stored, fingerprint=fingerprint,
                   shifted=shifted, lossless=exact, cuts=known_cuts)

    def to_float(self) -> tuple[np.ndarray, np.ndarray]:
        """Float32 ``(keys, values)``, fresh writable arrays ready to set into a model."""
        if self.precision == RAW_BLOCKS:
            key_layout, value_layout = self._layouts()
            keys = [key_layout.dequantize(layer, self.num_tokens) for layer in self.keys]
            values = [value_layout.dequantize(layer, self.num_tokens) for layer in self.values]
            return np.stack(keys)[:, None], np.stack(values)[:, None]
        if self.precision == "u8":
            assert self.key_scale is not None and self.key_zero is not None
            assert self.value_scale is not None and self.value_zero is not None
            return (dequantize_u8(self.keys, self.key_scale, self.key_zero),
                    dequantize_u8(self.values, self.value_scale, self.value_zero))
        if self.precision == "bf16":
            return from_bf16_bits(self.keys), from_bf16_bits(self.values)
        return self.keys.astype(np.float32, copy=True), self.values.astype(np.float32, copy=True)

    def write_into(self, slot: WritableSlot) -> None:
        """Copy this KV into ``slot`` (replacing what it held): ``snapshot.write_into(slot)``.
        Raw blocks go into a slot of the same block layout as they are."""
        if self.precision == RAW_BLOCKS:
            if not hasattr(slot, "write_blocks"):
                raise SnapshotIncompatible("a u8-paged snapshot restores only into a paged engine with a u8 "
                                           "cache; re-prefill the history instead")
            slot.write_blocks(self.keys, self.values, self.num_tokens)
            return
        if self.precision in ("f16", "bf16") and getattr(slot, "stored_precision", None) == self.precision:
            slot.write(self.keys, self.values)  # NOTE: the cache stores this very form: no float32 pass
            return
        slot.write(*self.to_float())

    def release(self) -> None:
        """Nothing to let go: a snapshot is a host copy (the ``KVSource`` protocol asks for it)."""

    def prefix(self, n: int) -> KVSnapshot:
        """The snapshot of the first ``n`` tokens (views, the cuts before ``n``):
        ``snap.prefix(32).tokens == snap.tokens[:32]``."""
        if not 0 <= n <= self.num_tokens:
            raise UserError(f"prefix length must be in 0..{self.num_tokens}, got {n}")
        return KVSnapshot(**sliced_fields(self, 0, n, prefix_cuts(self.cuts, n), copy=False))

    def span(self, start: int, stop: int) -> KVSnapshot:
        """The KV of ``tokens[start:stop]`` as a snapshot owning its arrays, cuts counted from
        ``start`` (0 among them when a pass began there): ``snap.span(64, 128).tokens ==
        snap.tokens[64:128]``. Raw u8 blocks are cut at block bounds only (``kv/snapshot_spans.py``)."""
        return KVSnapshot(**span_fields(self, start, stop))

    @classmethod
    def join(cls, parts: Sequence[KVSnapshot]) -> KVSnapshot:
        """Consecutive spans as one snapshot — ``span``'s inverse: ``KVSnapshot.join([s.span(0, a),
        s.span(a, s.num_tokens)])`` equals ``s`` (tokens, arrays bit for bit, cuts)."""
        return cls(**joined_fields(parts))

    @property
    def num_tokens(self) -> int:
        """Tokens held (the T axis)."""
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold in memory (K, V and any u8 scale/zero arrays)."""
        held = [self.keys, self.values, *(getattr(self, name) for name in QUANT_PARAMS)]
        return sum(a.nbytes for a in held if a is not None)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in this precision and layout (K + V + u8 params)."""
        if self.precision == RAW_BLOCKS:
            assert self.block_tokens is not None
            per_block = int(np.prod(self.keys.shape[2:])) + int(np.prod(self.values.shape[2:]))
            return int(self.keys.shape[0]) * per_block // self.block_tokens
        layers, batch, heads, _, head_dim = self.keys.shape
        per_vector = int(head_dim) * int(self.keys.dtype.itemsize)
        if self.precision == "u8":
            assert self.key_scale is not None and self.value_scale is not None
            per_vector += 2 * int(self.key_scale.dtype.itemsize)  # scale + zero
        return 2 * int(layers) * int(batch) * int(heads) * per_vector

    def _arrays(self) -> dict[str, np.ndarray | None]:
        """Every array in payload order; the token log travels as int64."""
        arrays: dict[str, np.ndarray | None] = {
            "tokens": np.asarray(self.tokens, dtype="<i8").reshape(-1),
            "keys": self.keys,
            "values": self.values,
        }
        arrays.update({name: getattr(self, name) for name in QUANT_PARAMS})
        # NOTE: absent when unknown: files written before cuts existed keep their checksums
        arrays["cuts"] = None if self.cuts is None else np.asarray(self.cuts, dtype="<i8").reshape(-1)
        return arrays

    def _metadata(self) -> dict[str, Any]:
        """What identifies the snapshot apart from its bytes (covered by the checksum)."""
        # NOTE: "lossless" is written only when True: files made before the flag existed lack it,
        # read back as lossless=False, and their checksums still verify.
        flag: dict[str, Any] = {"lossless": True} if self.lossless else {}
        if self.block_tokens is not None:
            flag["block_tokens"] = self.block_tokens
        return {
            "precision": self.precision,
            "fingerprint": self.fingerprint,
            "shifted": self.shifted,
            **flag,
            "num_tokens": self.num_tokens,
            "arrays": [
                {"name": name, "dtype": array.dtype.newbyteorder("<").str, "shape": list(array.shape)}
                for name, array in self._arrays().items()
                if array is not None
            ],
        }

    def checksum(self) -> str:
        """blake2b-256 hex digest over the metadata and every array byte (prefixed "blake2b:")."""
        return self._digest

    @cached_property
    def _digest(self) -> str:
        # NOTE: computed once; the arrays are read-only views, so the digest cannot go stale.
        return content_checksum(self._metadata(), (a for a in self._arrays().values() if a is not None))

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write a safetensors snapshot file atomically (temp file, fsync, ``os.replace``):
        ``snap.to_file("s.agkv")``. ``path`` keeps its old content or holds the whole new snapshot."""
        header = {key: value for key, value in self._metadata().items() if key not in ("arrays", "num_tokens")}
        header["lossless"] = self.lossless
        write_payload(path, {name: array for name, array in self._arrays().items() if array is not None},
                      {**header, "checksum": self.checksum()})

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, expected_fingerprint: str | None = None
    ) -> KVSnapshot:
        """Read and verify a snapshot file (safetensors, or the older raw layout):
        ``KVSnapshot.from_file("s.agkv", expected_fingerprint=fp)``.

        Raises ``SnapshotCorrupt`` (damaged, truncated, unreadable or missing file) or
        ``SnapshotIncompatible`` (another fingerprint or a newer file format).
        """
        target = Path(path)
        payload = read_payload(target)
        snapshot = _build(payload, target)
        if snapshot.checksum() != payload.header.get("checksum"):
            raise corrupt(target, "fails its checksum")
        if expected_fingerprint is not None and snapshot.fingerprint != expected_fingerprint:
            raise SnapshotIncompatible(
                f"snapshot {target} was made for {snapshot.fingerprint!r}, not "
                f"{expected_fingerprint!r}; restore it with that model and KV precision, or "
                "delete it and let the session re-prefill"
            )
        return snapshot


def _build(payload: SnapshotPayload, path: Path) -> KVSnapshot:
    """The snapshot the verified header and arrays describe; layout errors mean a damaged file."""
    header, arrays = payload.header, payload.arrays
    try:
        return KVSnapshot(
            tokens=tuple(arrays["tokens"].tolist()),
            keys=arrays["keys"],
            values=arrays["values"],
            precision=header["precision"],
            fingerprint=str(header["fingerprint"]),
            shifted=bool(header["shifted"]),
            lossless=header.get("lossless") is True,
            **{name: arrays.get(name) for name in QUANT_PARAMS},
            block_tokens=_block_tokens(header.get("block_tokens")),
            cuts=None if "cuts" not in arrays else arrays["cuts"].tolist(),
        )
    except (KeyError, UserError) as e:
        raise corrupt(path, f"has an inconsistent layout ({e})") from e


def _block_tokens(value: Any) -> int | None:
    """The header's block size (an int or absent); anything else is a damaged header."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise UserError(f"block_tokens must be an integer, got {value!r}")
