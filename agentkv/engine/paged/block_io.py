"""Block I/O: KV read from and written to pool blocks — the runner side's copies in and out of the cache tensors.

A ``BlockTable`` (the cache side) names the blocks; these functions move the KV they hold,
as float32 (a u8 cache dequantised or quantised in the plugin's block layout, ``kv/u8_blocks.py``),
in the cache's own 16-bit storage, or as raw blocks (the bit-exact form of any cache)::

    keys, values = read_table(model, table.row, table.length)      # [layers, 1, heads, T, dim]
    write_table(model, table.row, keys, values)                   # the blocks must cover T
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from agentkv.engine.paged.block_pool import BLOCK_SIZE
from agentkv.engine.paged.model import PagedModel
from agentkv.errors import UserError
from agentkv.kv.precision import from_bf16_bits, to_bf16_bits


def read_raw_blocks(model: PagedModel, blocks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Raw K ``[layers, n, *key block]`` and V ``[layers, n, *value block]`` of ``blocks`` (copies)."""
    picked = list(blocks)
    with model.lock:
        layers = [(k[picked], v[picked]) for k, v in model.cache_layers()]
    return np.stack([k for k, _ in layers]), np.stack([v for _, v in layers])


def read_table(model: PagedModel, blocks: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 K and V ``[layers, 1, heads, length, head_dim]`` held by a block table (copies)."""
    keys, values = [], []
    with model.lock:
        for k_cache, v_cache in model.cache_layers():
            keys.append(_gather(model, k_cache, list(blocks), length, key=True))
            values.append(_gather(model, v_cache, list(blocks), length, key=False))
    return np.stack(keys)[:, None], np.stack(values)[:, None]


def read_table_stored(model: PagedModel, blocks: Sequence[int], length: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V ``[layers, 1, heads, length, head_dim]`` of a block table in the cache's own 16-bit
    storage (float16, or a bf16 cache's bits as uint16), no float32 pass: copies for a snapshot."""
    if model.kv_cache_precision not in ("f16", "bf16"):
        raise UserError(f"a {model.kv_cache_precision} cache has no 16-bit storage to read: use read_table")
    keys, values = [], []
    with model.lock:
        for k_cache, v_cache in model.cache_layers():
            keys.append(_flat(k_cache[list(blocks)], length))
            values.append(_flat(v_cache[list(blocks)], length))
    return np.stack(keys)[:, None], np.stack(values)[:, None]


def _flat(picked: np.ndarray, length: int) -> np.ndarray:
    """``[heads, length, dim]`` of blocks ``[n, heads, rows, dim]`` (rows: a block's positions)."""
    heads, dim = picked.shape[1], picked.shape[3]
    return picked.transpose(1, 0, 2, 3).reshape(heads, -1, dim)[:, :length]


def _gather(model: PagedModel, cache: np.ndarray, blocks: list[int], length: int, *, key: bool) -> np.ndarray:
    """``[heads, length, dim]`` float32 from ``cache[blocks]`` (``[n, heads, rows, cols]``; a bf16
    cache shows as 16-bit numbers: its bits are converted, not its values)."""
    picked = cache[blocks]
    if model.kv_cache_precision == "u8":
        return model.u8_layout(key=key).dequantize(picked, length)
    flat = _flat(picked, length)
    if model.kv_cache_precision == "bf16":
        return from_bf16_bits(flat.view(np.uint16))
    return np.array(flat, dtype=np.float32)


def _scatter(model: PagedModel, cache: np.ndarray, blocks: list[int], kv: np.ndarray, *, key: bool) -> None:
    """Write ``kv`` ``[heads, T, dim]`` into ``cache[blocks]`` (the tail of the last block is zeroed)."""
    if model.kv_cache_precision == "u8":
        cache[blocks] = model.u8_layout(key=key).quantize(kv, len(blocks))
        return
    heads, length, dim = kv.shape
    bf16 = model.kv_cache_precision == "bf16"
    target = cache.view(np.uint16) if bf16 else cache
    padded = np.zeros((heads, len(blocks) * BLOCK_SIZE, dim), dtype=target.dtype)
    stored = kv.dtype.itemsize == 2  # NOTE: already the cache's form (f16 values, bf16 bits)
    padded[:, :length] = to_bf16_bits(kv) if bf16 and not stored else kv.view(target.dtype) if stored else kv
    target[blocks] = padded.reshape(heads, len(blocks), BLOCK_SIZE, dim).transpose(1, 0, 2, 3)


def write_table(model: PagedModel, blocks: Sequence[int], keys: np.ndarray, values: np.ndarray) -> None:
    """Write K and V ``[layers, 1, heads, T, head_dim]`` (float32, or the cache's 16-bit storage
    form) into ``blocks``, which cover ``T`` positions."""
    with model.lock:
        for layer, (k_cache, v_cache) in enumerate(model.cache_layers()):
            _scatter(model, k_cache, list(blocks), keys[layer, 0], key=True)
            _scatter(model, v_cache, list(blocks), values[layer, 0], key=False)


def write_raw_blocks(model: PagedModel, blocks: Sequence[int], keys: np.ndarray, values: np.ndarray) -> None:
    """Write raw K ``[layers, n, *key block]`` and V blocks (``read_raw_blocks``' form) into ``blocks``."""
    picked = list(blocks)
    with model.lock:
        for layer, (k_cache, v_cache) in enumerate(model.cache_layers()):
            k_cache[picked] = keys[layer]
            v_cache[picked] = values[layer]
