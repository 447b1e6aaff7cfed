"""Content digests of KV data: a token log's short digest and a snapshot's checksum (blake2b).

    tokens_digest([1, 2, 3])                                   # 32 hex digits
    content_checksum({"precision": "f16"}, [keys, values])     # "blake2b:" + 64 hex digits
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

__all__ = ["content_checksum", "tokens_digest"]


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short hex digest of a token log (int64 little-endian), e.g. to match a snapshot to a log:
    ``tokens_digest([1, 2, 3]) != tokens_digest([3, 2, 1])``."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def content_checksum(metadata: Mapping[str, Any], arrays: Iterable[np.ndarray]) -> str:
    """blake2b-256 over ``metadata`` (sorted-key JSON) then each array's bytes in C order and
    little-endian byte order, prefixed "blake2b:": ``content_checksum(meta, [keys, values])``."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    for array in arrays:
        contiguous = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        digest.update(contiguous.data.cast("B"))
    return "blake2b:" + digest.hexdigest()
