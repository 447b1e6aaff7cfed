"""KV snapshot files: write a snapshot's arrays and header as safetensors, read them back (old files too).

A snapshot file is a `safetensors <https://huggingface.co/docs/safetensors>`_ file: the arrays
(``tokens`` int64, ``keys``, ``values`` and u8 ``key_scale``... in their storage dtype) plus one
string metadata entry, ``agentkv.kv_snapshot``, holding the snapshot's JSON header (precision,
fingerprint, flags, format version and checksum). Any safetensors reader opens it::

    write_payload(path, {"tokens": tokens, "keys": keys, "values": values}, header)
    payload = read_payload(path)          # SnapshotPayload(header={...}, arrays={...})

Files written before safetensors (``b"AGKVSNAP" | u32 version | u32 header length | header JSON
| raw little-endian arrays``, versions 1 and 2) are still read. This module checks the container
(truncation, foreign files, newer versions); ``KVSnapshot.from_file`` checks the contents (layout,
checksum, fingerprint).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import struct
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible

__all__ = ["FORMAT_VERSION", "HEADER_KEY", "SnapshotPayload", "corrupt", "read_payload", "write_payload"]

FORMAT_VERSION = 3
"""The newest file format this code reads and the one it writes: 3 is safetensors; 1 (float
arrays) and 2 (raw u8 paged blocks) are the older raw layout, still read."""
HEADER_KEY = "agentkv.kv_snapshot"
"""The safetensors metadata key that holds the snapshot's JSON header."""
LEGACY_MAGIC = b"AGKVSNAP"
"""The first bytes of a file written before format 3."""
_LEGACY_PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length
_SAFETENSORS_PREAMBLE = struct.Struct("<Q")  # header length
_FIRST_SAFETENSORS_VERSION = 3
_MAX_HEADER_BYTES = 1 << 20
_HEADER_FIELDS = {"precision": str, "fingerprint": str, "shifted": bool, "lossless": bool, "checksum": str}
"""The fields every safetensors snapshot header has, with their JSON types (older files may lack "lossless")."""


@dataclass(frozen=True)
class SnapshotPayload:
    """What a snapshot file holds: ``payload.header["checksum"]``, ``payload.arrays["keys"]``."""

    header: dict[str, Any]
    """The JSON header: precision, fingerprint, shifted, lossless, block_tokens, checksum..."""
    arrays: dict[str, np.ndarray]
    """Every array by name, in its stored dtype and shape."""


def corrupt(path: Path, what: str) -> SnapshotCorrupt:
    """The error for a damaged file, saying what to do: ``raise corrupt(path, "fails its checksum")``."""
    return SnapshotCorrupt(f"KV snapshot {path} {what}; delete it, the session will re-prefill from its history")


def write_payload(path: str | os.PathLike[str], arrays: Mapping[str, np.ndarray], header: Mapping[str, Any]) -> None:
    """Write ``arrays`` and ``header`` as a safetensors file, atomically: a temp file in the same
    directory, fsync, then ``os.replace``; ``path`` keeps its old content or holds the whole new one::

        write_payload("s.agkv", {"tokens": np.arange(3), "keys": k, "values": v}, {"checksum": "..."})
    """
    target = Path(path)
    metadata = {HEADER_KEY: json.dumps({"format_version": FORMAT_VERSION, **header}, sort_keys=True)}
    # NOTE: safetensors writes from each array's buffer: strided views (prefixes) need a contiguous copy
    tensors = {name: np.ascontiguousarray(array) for name, array in arrays.items()}
    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        os.close(fd)
        save_file(tensors, tmp_name, metadata=metadata)
        _fsync_file(tmp_name)
        os.replace(tmp_name, target)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _fsync_directory(target.parent)


def read_payload(path: str | os.PathLike[str]) -> SnapshotPayload:
    """Read a snapshot file of any format this code knows: ``read_payload("s.agkv").header``.

    Raises ``SnapshotCorrupt`` (truncated, foreign, unreadable or missing file) or
    ``SnapshotIncompatible`` (a format newer than ``FORMAT_VERSION``).
    """
    target = Path(path)
    try:
        with target.open("rb") as f:
            start = f.read(len(LEGACY_MAGIC))
            if start == LEGACY_MAGIC:
                f.seek(0)
                header = _read_legacy_header(f, target)
                return SnapshotPayload(header, _read_legacy_arrays(f, header, target))
            _check_safetensors_start(start, f.read(1), target)
        return _read_safetensors(target)
    except OSError as e:
        raise corrupt(target, f"cannot be read ({e})") from e


def _check_safetensors_start(start: bytes, first_header_byte: bytes, path: Path) -> None:
    """A safetensors file starts with a sane header length and a JSON object; else it is foreign."""
    if len(start) < _SAFETENSORS_PREAMBLE.size:
        raise corrupt(path, "is truncated (no header)")
    (header_len,) = _SAFETENSORS_PREAMBLE.unpack(start)
    if header_len > _MAX_HEADER_BYTES or first_header_byte not in (b"{", b""):
        raise corrupt(path, "is not an agentkv snapshot (bad magic)")


def _read_safetensors(path: Path) -> SnapshotPayload:
    try:
        # NOTE: pread, not a memory map: as fast here, and a file cut short under us is an error, not SIGBUS
        with safe_open(path, framework="np", backend="pread") as f:
            metadata = f.metadata() or {}
            if HEADER_KEY not in metadata:
                raise corrupt(path, "is not an agentkv snapshot (no agentkv header)")
            header = _header_object(metadata[HEADER_KEY], path)
            _check_version(header.get("format_version"), path, oldest=_FIRST_SAFETENSORS_VERSION)
            if any(not isinstance(header.get(key), kind) for key, kind in _HEADER_FIELDS.items()):
                raise corrupt(path, "has a damaged header")
            arrays: dict[str, np.ndarray] = f.get_tensors()
    except SafetensorError as e:
        raise corrupt(path, f"is truncated or has a damaged header ({e})") from e
    return SnapshotPayload(header, arrays)


def _header_object(raw: str | bytes, path: Path) -> dict[str, Any]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as e:
        raise corrupt(path, "has a damaged header") from e
    if not isinstance(header, dict):
        raise corrupt(path, "has a damaged header")
    return header


def _check_version(version: object, path: Path, *, oldest: int) -> None:
    """Newer than this code reads: incompatible; older than the container allows: a damaged header."""
    if not isinstance(version, int) or isinstance(version, bool) or version < oldest:
        raise corrupt(path, "has a damaged header")
    if version > FORMAT_VERSION:
        raise SnapshotIncompatible(
            f"snapshot {path} has format version {version}, newer than {FORMAT_VERSION}; "
            "upgrade agentkv, or delete it and let the session re-prefill"
        )


def _read_legacy_header(f: io.BufferedReader, path: Path) -> dict[str, Any]:
    preamble = f.read(_LEGACY_PREAMBLE.size)
    if len(preamble) != _LEGACY_PREAMBLE.size:
        raise corrupt(path, "is truncated (no header)")
    _, version, header_len = _LEGACY_PREAMBLE.unpack(preamble)
    _check_version(version, path, oldest=1)
    if header_len > _MAX_HEADER_BYTES:
        raise corrupt(path, "has a damaged header")
    header = _header_object(f.read(header_len), path)
    if not isinstance(header.get("arrays"), list):
        raise corrupt(path, "has a damaged header")
    return header


_LEGACY_KINDS = frozenset("biuf")
"""Array kinds old files hold (bool, ints, floats); anything else is a damaged header."""


def _read_legacy_arrays(f: io.BufferedReader, header: dict[str, Any], path: Path) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    for spec in header["arrays"]:
        try:
            dtype = np.dtype(spec["dtype"])
            shape = tuple(int(d) for d in spec["shape"])
            name = str(spec["name"])
        except (KeyError, TypeError, ValueError) as e:
            raise corrupt(path, "has a damaged header") from e
        if dtype.kind not in _LEGACY_KINDS or dtype.itemsize == 0 or any(d < 0 for d in shape):
            raise corrupt(path, "has a damaged header")
        size = math.prod(shape) * dtype.itemsize  # Python ints: a lying shape cannot overflow
        if size > os.fstat(f.fileno()).st_size - f.tell():
            raise corrupt(path, "is truncated (its header names more bytes than the file holds)")
        buffer = bytearray(size)
        if f.readinto(buffer) != size:
            raise corrupt(path, "is truncated")
        arrays[name] = np.frombuffer(buffer, dtype=dtype).reshape(shape)
    if f.read(1):
        raise corrupt(path, "has trailing bytes after its arrays")
    return arrays


def _fsync_file(name: str) -> None:
    fd = os.open(name, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
