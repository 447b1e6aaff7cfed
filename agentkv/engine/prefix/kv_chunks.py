"""KV snapshots cut and joined along the token axis: how the radix tree splits an edge's KV
and gives a match spanning several edges back as one snapshot::

    head = slice_chunk(edge_kv, 0, 16)           # the first 16 tokens' KV (copies)
    whole = join_chunks([head, slice_chunk(edge_kv, 16, 40)])
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from agentkv.kv.snapshot import KVSnapshot


def slice_chunk(chunk: KVSnapshot, start: int, stop: int) -> KVSnapshot:
    """Tokens ``start:stop`` of ``chunk`` as a snapshot owning its arrays (frees the rest); it
    keeps ``chunk``'s ``shifted`` and ``lossless`` flags."""
    def cut(array: np.ndarray) -> np.ndarray:
        return array[:, :, :, start:stop].copy()

    return _build(chunk, chunk.tokens[start:stop], lambda name: _maybe(getattr(chunk, name), cut),
                  shifted=chunk.shifted, lossless=chunk.lossless)


def join_chunks(chunks: list[KVSnapshot]) -> KVSnapshot:
    """Consecutive chunks as one snapshot (the single chunk itself when there is one): shifted
    if any chunk is, lossless only if every chunk is."""
    if len(chunks) == 1:
        return chunks[0]

    def joined(name: str) -> np.ndarray | None:
        if getattr(chunks[0], name) is None:
            return None
        return np.concatenate([getattr(c, name) for c in chunks], axis=3)

    return _build(chunks[0], tuple(t for c in chunks for t in c.tokens), joined,
                  shifted=any(c.shifted for c in chunks), lossless=all(c.lossless for c in chunks))


def _maybe(array: np.ndarray | None, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray | None:
    return None if array is None else fn(array)


def _build(first: KVSnapshot, tokens: tuple[int, ...], array: Callable[[str], np.ndarray | None], *,
           shifted: bool, lossless: bool) -> KVSnapshot:
    """A snapshot of ``first``'s precision and fingerprint whose arrays are ``array(field name)``."""
    keys, values = array("keys"), array("values")
    assert keys is not None and values is not None
    return KVSnapshot(
        tokens=tokens, keys=keys, values=values, precision=first.precision, fingerprint=first.fingerprint,
        shifted=shifted, lossless=lossless, key_scale=array("key_scale"), key_zero=array("key_zero"),
        value_scale=array("value_scale"), value_zero=array("value_zero"),
    )
