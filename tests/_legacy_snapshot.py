"""The snapshot file writer of agentkv before safetensors (formats 1 and 2), kept to test that old files still read.

    write_legacy(snapshot, path)      # b"AGKVSNAP" | u32 version | u32 header length | header JSON | arrays
    KVSnapshot.from_file(path)        # reads it back bit for bit
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from agentkv.kv.snapshot import QUANT_PARAMS, RAW_BLOCKS, KVSnapshot

MAGIC = b"AGKVSNAP"
PREAMBLE = struct.Struct("<8sII")  # magic, format version, header length


def legacy_arrays(snapshot: KVSnapshot) -> dict[str, np.ndarray]:
    """Every array in payload order, as the old writer laid them out (the token log as int64)."""
    arrays = {"tokens": np.asarray(snapshot.tokens, dtype="<i8").reshape(-1),
              "keys": snapshot.keys, "values": snapshot.values}
    arrays.update({name: getattr(snapshot, name) for name in QUANT_PARAMS if getattr(snapshot, name) is not None})
    return arrays


def write_legacy(snapshot: KVSnapshot, path: Path) -> None:
    """Write ``snapshot`` as the old writer did (temp file, fsync, rename): version 1, or 2 for raw
    u8 paged blocks."""
    version = 2 if snapshot.precision == RAW_BLOCKS else 1
    arrays = legacy_arrays(snapshot)
    flag: dict[str, object] = {"lossless": True} if snapshot.lossless else {}
    if snapshot.block_tokens is not None:
        flag["block_tokens"] = snapshot.block_tokens
    header = {
        "format_version": version, "precision": snapshot.precision, "fingerprint": snapshot.fingerprint,
        "shifted": snapshot.shifted, **flag, "num_tokens": snapshot.num_tokens,
        "arrays": [{"name": name, "dtype": a.dtype.newbyteorder("<").str, "shape": list(a.shape)}
                   for name, a in arrays.items()],
        "checksum": snapshot.checksum(),
    }
    header_bytes = json.dumps(header, sort_keys=True).encode()
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as out:  # temp file, fsync, rename: as the old writer did
        out.write(PREAMBLE.pack(MAGIC, version, len(header_bytes)))
        out.write(header_bytes)
        for a in arrays.values():
            out.write(memoryview(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))).cast("B"))
        out.flush()
        os.fsync(out.fileno())
    os.replace(tmp_name, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
