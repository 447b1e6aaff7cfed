"""Content digests of KV data: the canonical bytes of token ids, a token log's short digest and a
snapshot's checksum (blake2b).

    int64_bytes([1, 2, 3])                                     # 24 bytes, int64 little-endian
    tokens_digest([1, 2, 3])                                   # 32 hex digits
    content_checksum({"precision": "f16"}, [keys, values])     # "blake2b:" + 64 hex digits
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from agentkv.errors import UserError

__all__ = ["content_checksum", "int64_bytes", "tokens_digest"]

_INT64_MAX = 2**63 - 1


def int64_bytes(values: Sequence[int] | np.ndarray, *, what: str = "token ids",
                fix: str = "pass the tokenizer's ids as a list of ints") -> bytes:
    """The canonical encoding of non-negative integers (token ids, positions) that every digest
    over them uses: int64 little-endian, whatever the host or the process (never ``hash()``):
    ``int64_bytes([1, 2]) == b"\\x01" + b"\\x00" * 7 + b"\\x02" + b"\\x00" * 7``.

    Raises ``UserError`` (naming ``what``, ending with ``fix``: what to do) for anything else:
    floats, bools, strings, negative numbers or numbers past int64."""
    try:
        array = np.asarray(values)
    except (OverflowError, ValueError, TypeError) as error:
        raise UserError(f"{what} must be a flat sequence of non-negative ints ({error}); {fix}") from error
    if array.size == 0:
        return b""
    if array.ndim != 1 or array.dtype.kind not in "iu":
        raise UserError(f"{what} must be a flat sequence of non-negative ints, got {_described(array)}; {fix}")
    if array.dtype.kind == "i" and int(array.min()) < 0:
        raise UserError(f"{what} must be non-negative, got {int(array.min())} at index "
                        f"{int(array.argmin())}; {fix}")
    if array.dtype.kind == "u" and int(array.max()) > _INT64_MAX:
        raise UserError(f"{what} must fit int64, got {int(array.max())}; {fix}")
    return array.astype("<i8", copy=False).tobytes()


def tokens_digest(tokens: Sequence[int]) -> str:
    """A short hex digest of a token log (``int64_bytes``), e.g. to match a snapshot to a log:
    ``tokens_digest([1, 2, 3]) != tokens_digest([3, 2, 1])``."""
    return hashlib.blake2b(int64_bytes(tokens), digest_size=16).hexdigest()


def content_checksum(metadata: Mapping[str, Any], arrays: Iterable[np.ndarray]) -> str:
    """blake2b-256 over ``metadata`` (sorted-key JSON) then each array's bytes in C order and
    little-endian byte order, prefixed "blake2b:": ``content_checksum(meta, [keys, values])``."""
    digest = hashlib.blake2b(digest_size=32)
    digest.update(json.dumps(metadata, sort_keys=True).encode())
    for array in arrays:
        if array.size == 0:  # NOTE: no bytes to add (a log's empty tail); a memoryview cannot cast it
            continue
        contiguous = np.ascontiguousarray(array, dtype=array.dtype.newbyteorder("<"))
        digest.update(contiguous.data.cast("B"))
    return "blake2b:" + digest.hexdigest()


def _described(array: np.ndarray) -> str:
    if array.ndim != 1:
        return f"an array of shape {array.shape}"
    kinds = {"b": "bools", "f": "floats", "U": "strings", "S": "bytes", "O": "mixed objects", "c": "complex numbers"}
    return kinds.get(array.dtype.kind, f"values of type {array.dtype}")
