"""KV snapshots as plain numpy arrays: quantise, slice, checksum, and write/read snapshot files.

The engine reads each layer's K and V state as float32 ``[batch, heads, T, head_dim]``,
stacks them on a layer axis and hands them here; nothing in this module knows OpenVINO::

    snap = KVSnapshot.from_float(tokens, keys, values, precision="u8", fingerprint=fp)
    snap.to_file(path)
    keys, values = KVSnapshot.from_file(path, expected_fingerprint=fp).to_float()

File layout (little-endian, no pickle)::

    b"AGKVSNAP" | u32 format version | u32 header length | header JSON (utf-8) | raw arrays

The header lists every array's name, dtype and shape in payload order plus the
snapshot's ``checksum()``, which covers the metadata and every array byte.

Exactness: ``precision="auto"`` stores the smallest form that gives back the very float32
values it was made from — bf16 (the upper half of each float32) when every value is a
bfloat16, else f16 when every value is a float16, else f32 — so ``to_float()`` returns the
input bit for bit (``snap.lossless`` is True). An explicit ``"f16"`` or ``"u8"`` may round;
``lossless`` then says whether it did.

A u8 paged cache is snapshotted as its raw blocks (``precision="u8-paged"``, built with
``KVSnapshot.from_blocks``): the only copy of it that restores bit for bit, at u8 size.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, BinaryIO, Literal, Protocol

import numpy as np

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
from agentkv.kv.u8_blocks import BlockLayout
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError

__all__ = ["FORMAT_VERSION", "SUFFIX", "KVSnapshot", "Precision", "PrecisionChoice", "dequantize_u8", "from_bf16_bits",
           "holds_exactly", "lossless_precision", "quantize_u8", "to_bf16_bits", "tokens_digest"]

MAGIC = b"AGKVSNAP"
SUFFIX = ".agkv"
"""The file suffix of every KV snapshot file (the store's, and the engine's spill files)."""
FORMAT_VERSION = 2
"""The newest file format this code reads. Files are written as 1 unless they hold raw u8 paged
blocks (2), so an older agentkv says "upgrade" for those and still reads the rest."""
_PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
_MAX_HEADER_BYTES = 1 << 20
_STORAGE_DTYPE: dict[str, np.dtype[Any]] = {
    "f32": np.dtype("<f4"),
    "bf16": np.dtype("<u2"),
    "f16": np.dtype("<f2"),
    "u8": np.dtype("u1"),
    "u8-paged": np.dtype("u1"),
}
RAW_BLOCKS = "u8-paged"
"""The storage precision of raw u8 paged blocks (parameters inside the blocks)."""
_PARAM_DTYPES = (np.dtype("<f4"), np.dtype("<f2"))
QUANT_PARAMS = ("key_scale", "key_zero", "value_scale", "value_zero")
"""The ``KVSnapshot`` fields holding u8 quantisation parameters (all None unless the precision is u8)."""


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short hex digest of a token log (int64 little-endian), e.g. to match a snapshot to a log."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only view of ``a`` (the caller's array keeps its own flags)."""
    view = a.view()
    view.setflags(write=False)
    return view


class WritableSlot(Protocol):
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "tokens", tuple(int(t) for t in self.tokens))
        self._check_layout()
        for name in ("keys", "values", *QUANT_PARAMS):
            array = getattr(self, name)
            if array is not None:
                object.__setattr__(self, name, _read_only(array))

    def _check_layout(self) -> None:
        if self.precision not in _STORAGE_DTYPE:
            raise UserError(f"precision must be one of f32, bf16, f16, u8, u8-paged, not {self.precision!r}")
        if self.precision == RAW_BLOCKS:
            self._check_blocks()
            return
        if self.block_tokens is not None:
            raise UserError("block_tokens belongs to u8-paged snapshots only")
        dtype = _STORAGE_DTYPE[self.precision]
        if self.keys.ndim != 5 or self.keys.shape != self.values.shape:
            raise UserError(
                "keys and values must share one shape [layers, batch, heads, T, head_dim]; got "
                f"{self.keys.shape} and {self.values.shape}"
            )
        if self.keys.dtype != dtype or self.values.dtype != dtype:
            raise UserError(
                f"precision {self.precision} stores {dtype}, got {self.keys.dtype}/{self.values.dtype}; "
                "build snapshots with KVSnapshot.from_float"
            )
        if self.keys.shape[3] != len(self.tokens):
            raise UserError(f"KV holds {self.keys.shape[3]} tokens but the log has {len(self.tokens)}")
        params = [getattr(self, name) for name in QUANT_PARAMS]
        if self.precision != "u8":
            if any(p is not None for p in params):
                raise UserError("scale/zero arrays belong to u8 snapshots only")
            return
        for name, p in zip(QUANT_PARAMS, params):
            if p is None or p.shape != self.keys.shape[:4] or p.dtype not in _PARAM_DTYPES:
                got = None if p is None else (p.shape, str(p.dtype))
                raise UserError(
                    f"u8 snapshot needs {name} of shape {self.keys.shape[:4]} in float32/float16, "
                    f"got {got}"
                )

    def _check_blocks(self) -> None:
        keys, values = self.keys, self.values
        if self.block_tokens is None or self.block_tokens < 1:
            raise UserError("a u8-paged snapshot needs block_tokens >= 1")
        if keys.ndim != 5 or values.ndim != 5 or keys.shape[:3] != values.shape[:3]:
            raise UserError(f"raw blocks must be [layers, blocks, heads, rows, cols] with the same leading "
                            f"axes for K and V; got {keys.shape} and {values.shape}")
        if keys.dtype != np.uint8 or values.dtype != np.uint8:
            raise UserError(f"u8-paged snapshots store uint8 blocks, got {keys.dtype}/{values.dtype}")
        if keys.shape[1] != -(-len(self.tokens) // self.block_tokens):
            raise UserError(f"{keys.shape[1]} blocks of {self.block_tokens} tokens do not hold exactly "
                            f"{len(self.tokens)} tokens")
        if any(getattr(self, name) is not None for name in QUANT_PARAMS):
            raise UserError("scale/zero arrays belong to u8 snapshots only")
        self._layouts()  # raises on an unknown block shape

    def _layouts(self) -> tuple[BlockLayout, BlockLayout]:
        assert self.block_tokens is not None
        return (BlockLayout.of(self.keys.shape[2:], block_tokens=self.block_tokens),
                BlockLayout.of(self.values.shape[2:], block_tokens=self.block_tokens))

    @classmethod
    def from_blocks(cls, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, *, block_tokens: int,
                    fingerprint: str, shifted: bool = False, lossless: bool = True) -> KVSnapshot:
        """A u8 paged cache's raw blocks ``[layers, blocks, heads, rows, cols]`` (as
        ``PagedSlot.read_blocks`` gives them) holding ``tokens``; restores bit for bit::

            snap = KVSnapshot.from_blocks(tokens, *slot.read_blocks(), block_tokens=32, fingerprint=fp)
        """
        if np.asarray(keys).dtype != np.uint8 or np.asarray(values).dtype != np.uint8:
            raise UserError("from_blocks takes a u8 cache's raw blocks (uint8); snapshot float caches with from_float")
        return cls(tokens=tuple(tokens), keys=np.array(keys), values=np.array(values),
                   precision=RAW_BLOCKS, fingerprint=fingerprint, shifted=shifted, lossless=lossless,
                   block_tokens=block_tokens)

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
    ) -> KVSnapshot:
        """Store float K/V ``[layers, batch, heads, T, head_dim]`` in ``precision`` ("auto": the
        smallest lossless form). ``lossless=False`` marks KV that was inexact before capture.

        The result owns copies: later writes to ``keys_f32`` do not change the snapshot.
        """
        keys = np.asarray(keys_f32, dtype=np.float32)
        values = np.asarray(values_f32, dtype=np.float32)
        if precision == "auto":
            precision = lossless_precision(keys, values)
        common = {"tokens": tuple(tokens), "precision": precision, "fingerprint": fingerprint,
                  "shifted": shifted}
        if precision == "u8":
            kq, ks, kz = quantize_u8(keys)
            vq, vs, vz = quantize_u8(values)
            return cls(keys=kq, values=vq, key_scale=ks, key_zero=kz, value_scale=vs,
                       value_zero=vz, lossless=False, **common)
        if precision not in _STORAGE_DTYPE:
            raise UserError(f"precision must be one of auto, f32, bf16, f16, u8, not {precision!r}")
        if precision == "bf16":
            stored_k, stored_v = to_bf16_bits(keys), to_bf16_bits(values)
        else:
            dtype = _STORAGE_DTYPE[precision]
            stored_k, stored_v = keys.astype(dtype, copy=True), values.astype(dtype, copy=True)
        exact = lossless and holds_exactly(precision, keys, values)
        return cls(keys=stored_k, values=stored_v, lossless=exact, **common)

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
        slot.write(*self.to_float())

    def release(self) -> None:
        """Nothing to let go: a snapshot is a host copy (the ``KVSource`` protocol asks for it)."""

    def prefix(self, n: int) -> KVSnapshot:
        """The snapshot of the first ``n`` tokens: ``snap.prefix(32).tokens == snap.tokens[:32]``."""
        if not 0 <= n <= self.num_tokens:
            raise UserError(f"prefix length must be in 0..{self.num_tokens}, got {n}")
        if self.precision == RAW_BLOCKS:
            assert self.block_tokens is not None
            blocks = -(-n // self.block_tokens)
            return KVSnapshot.from_blocks(self.tokens[:n], self.keys[:, :blocks], self.values[:, :blocks],
                                          block_tokens=self.block_tokens, fingerprint=self.fingerprint,
                                          shifted=self.shifted, lossless=self.lossless)
        cut: dict[str, Any] = {
            name: (None if getattr(self, name) is None else getattr(self, name)[:, :, :, :n])
            for name in QUANT_PARAMS
        }
        return KVSnapshot(
            tokens=self.tokens[:n], keys=self.keys[:, :, :, :n], values=self.values[:, :, :, :n],
            precision=self.precision, fingerprint=self.fingerprint, shifted=self.shifted,
            lossless=self.lossless, **cut,
        )

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
            return self.keys.shape[0] * per_block // self.block_tokens
        layers, batch, heads, _, head_dim = self.keys.shape
        per_vector = head_dim * self.keys.dtype.itemsize
        if self.precision == "u8":
            assert self.key_scale is not None and self.value_scale is not None
            per_vector += 2 * self.key_scale.dtype.itemsize  # scale + zero
        return 2 * layers * batch * heads * per_vector

    def _arrays(self) -> dict[str, np.ndarray | None]:
        """Every array in payload order; the token log travels as int64."""
        arrays: dict[str, np.ndarray | None] = {
            "tokens": np.asarray(self.tokens, dtype="<i8").reshape(-1),
            "keys": self.keys,
            "values": self.values,
        }
        arrays.update({name: getattr(self, name) for name in QUANT_PARAMS})
        return arrays

    def _metadata(self) -> dict[str, Any]:
        """What identifies the snapshot apart from its bytes (covered by the checksum)."""
        # NOTE: "lossless" is written only when True: files made before the flag existed lack it,
        # read back as lossless=False, and their checksums still verify.
        flag = {"lossless": True} if self.lossless else {}
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
        digest = hashlib.blake2b(digest_size=32)
        digest.update(json.dumps(self._metadata(), sort_keys=True).encode())
        for array in self._arrays().values():
            if array is not None:
                digest.update(_little_endian_bytes(array))
        return "blake2b:" + digest.hexdigest()

    def to_file(self, path: str | os.PathLike[str]) -> None:
        """Write atomically: a temp file in the same directory, fsync, then ``os.replace``.

        ``path`` either keeps its old content or holds the whole new snapshot, never a part.
        """
        target = Path(path)
        version = 2 if self.precision == RAW_BLOCKS else 1
        header = {"format_version": version, **self._metadata(), "checksum": self.checksum()}
        header_bytes = json.dumps(header, sort_keys=True).encode()
        fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(_PREAMBLE.pack(MAGIC, version, len(header_bytes)))
                out.write(header_bytes)
                for array in self._arrays().values():
                    if array is not None:
                        out.write(_little_endian_bytes(array))
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp_name, target)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _fsync_directory(target.parent)

    @classmethod
    def from_file(
        cls, path: str | os.PathLike[str], *, expected_fingerprint: str | None = None
    ) -> KVSnapshot:
        """Read and verify a snapshot file.

        Raises ``SnapshotCorrupt`` (damaged, truncated, unreadable or missing file) or
        ``SnapshotIncompatible`` (another fingerprint or a newer file format).
        """
        target = Path(path)
        try:
            with target.open("rb") as f:
                header = _read_header(f, target)
                arrays = _read_arrays(f, header, target)
        except OSError as e:
            raise SnapshotCorrupt(_corrupt_message(target, f"cannot be read ({e})")) from e
        snapshot = _build(header, arrays, target)
        if snapshot.checksum() != header.get("checksum"):
            raise SnapshotCorrupt(_corrupt_message(target, "fails its checksum"))
        if expected_fingerprint is not None and snapshot.fingerprint != expected_fingerprint:
            raise SnapshotIncompatible(
                f"snapshot {target} was made for {snapshot.fingerprint!r}, not "
                f"{expected_fingerprint!r}; restore it with that model and KV precision, or "
                "delete it and let the session re-prefill"
            )
        return snapshot


def _little_endian_bytes(array: np.ndarray) -> memoryview:
    """The array's bytes in C order and little-endian byte order."""
    contiguous = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
    return memoryview(contiguous).cast("B")


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable (POSIX); platforms that cannot open directories skip it."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on directories
            os.fsync(fd)
    finally:
        os.close(fd)


def _corrupt_message(path: Path, what: str) -> str:
    return f"KV snapshot {path} {what}; delete it, the session will re-prefill from its history"


def _read_header(f: BinaryIO, path: Path) -> dict[str, Any]:
    preamble = f.read(_PREAMBLE.size)
    if len(preamble) != _PREAMBLE.size:
        raise SnapshotCorrupt(_corrupt_message(path, "is truncated (no header)"))
    magic, version, header_len = _PREAMBLE.unpack(preamble)
    if magic != MAGIC:
        raise SnapshotCorrupt(_corrupt_message(path, "is not an agentkv snapshot (bad magic)"))
    if version > FORMAT_VERSION:
        raise SnapshotIncompatible(
            f"snapshot {path} has format version {version}, newer than {FORMAT_VERSION}; "
            "upgrade agentkv, or delete it and let the session re-prefill"
        )
    if version < 1 or header_len > _MAX_HEADER_BYTES:
        raise SnapshotCorrupt(_corrupt_message(path, "has a damaged header"))
    raw = f.read(header_len)
    try:
        header = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise SnapshotCorrupt(_corrupt_message(path, "has a damaged header")) from e
    if not isinstance(header, dict) or not isinstance(header.get("arrays"), list):
        raise SnapshotCorrupt(_corrupt_message(path, "has a damaged header"))
    return header


def _read_arrays(f: BinaryIO, header: dict[str, Any], path: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for spec in header["arrays"]:
        try:
            dtype = np.dtype(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
            name = str(spec["name"])
        except (KeyError, TypeError, ValueError) as e:
            raise SnapshotCorrupt(_corrupt_message(path, "has a damaged header")) from e
        if dtype.hasobject or any(d < 0 for d in shape):
            raise SnapshotCorrupt(_corrupt_message(path, "has a damaged header"))
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        buffer = bytearray(size)
        if f.readinto(buffer) != size:
            raise SnapshotCorrupt(_corrupt_message(path, "is truncated"))
        arrays[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    if f.read(1):
        raise SnapshotCorrupt(_corrupt_message(path, "has trailing bytes after its arrays"))
    return arrays


def _build(header: dict[str, Any], arrays: dict[str, np.ndarray], path: Path) -> KVSnapshot:
    """The snapshot the verified header and arrays describe; layout errors mean a damaged file."""
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
        )
    except (KeyError, UserError) as e:
        raise SnapshotCorrupt(_corrupt_message(path, f"has an inconsistent layout ({e})")) from e


def _block_tokens(value: Any) -> int | None:
    """The header's block size (an int or absent); anything else is a damaged header."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise UserError(f"block_tokens must be an integer, got {value!r}")
