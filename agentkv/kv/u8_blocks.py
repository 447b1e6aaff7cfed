"""The CPU plugin's u8 KV block layouts, read and written with numpy (no OpenVINO here).

A u8 paged cache keeps each block's quantisation parameters inside the block. Two layouts
occur (measured on OpenVINO 2026.4, CPU plugin; the compiled model's cache shapes say which):

- **by token** (values; keys on some CPUs): a block is ``[heads, T, 8 + dim]``; each token row
  starts with its f32 scale and f32 zero point, then ``dim`` u8 codes.
- **by channel** (keys on avx512 CPUs): a block is ``[heads, 8 + T, dim]``; rows 0–7 hold ``dim``
  f32 scales then ``dim`` f32 zero points, one per channel over the block's tokens; rows 8.. hold
  the tokens' u8 codes. The plugin re-quantises a block's earlier tokens as new ones join it.

A value is ``(code - zero) * scale``. ``T`` is the block size (32)::

    layout = BlockLayout.of(k_cache.shape[1:], block_tokens=32)      # by channel: rows 40, cols 64
    keys = layout.dequantize(k_cache[[4, 9]], length=50)             # [heads, 50, 64] float32
    k_cache[[4, 9]] = layout.quantize(keys, num_blocks=2)

Raw blocks copied as bytes are the only bit-exact copy of a u8 cache; ``quantize`` is for KV
that was changed as floats (a dropped span's re-rotated keys).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from agentkv.errors import UserError

_PARAM_BYTES = 8  # f32 scale + f32 zero point
_LEVELS = 255.0


@dataclass(frozen=True)
class BlockLayout:
    """Where a u8 block keeps its codes and parameters. See the module docstring for a call."""

    kind: Literal["by_token", "by_channel"]
    block_tokens: int
    head_dim: int

    @classmethod
    def of(cls, block_shape: tuple[int, ...], *, block_tokens: int, head_dim: int | None = None) -> BlockLayout:
        """The layout of blocks shaped ``[heads, rows, cols]`` holding ``block_tokens`` tokens
        (of ``head_dim`` each, when known: a shape that fits only with grouped parameters is refused)."""
        if len(block_shape) != 3:
            raise UserError(f"a u8 KV block is [heads, rows, cols], got shape {tuple(block_shape)}")
        _, rows, cols = (int(d) for d in block_shape)
        if rows == block_tokens and cols > _PARAM_BYTES and head_dim in (None, cols - _PARAM_BYTES):
            return cls("by_token", block_tokens, cols - _PARAM_BYTES)
        if rows == block_tokens + _PARAM_BYTES and head_dim in (None, cols):
            return cls("by_channel", block_tokens, cols)
        raise UserError(f"u8 KV blocks of shape {tuple(block_shape)} match no known layout for "
                        f"{block_tokens}-token blocks; use kv_cache_precision='f16'")

    def dequantize(self, blocks: np.ndarray, length: int) -> np.ndarray:
        """float32 ``[heads, length, head_dim]`` of ``blocks`` ``[n, heads, rows, cols]`` (u8)."""
        blocks = np.ascontiguousarray(blocks, dtype=np.uint8)
        if self.kind == "by_token":
            params = blocks[..., :_PARAM_BYTES].copy().view(np.float32)  # [n, heads, T, 2]
            codes = blocks[..., _PARAM_BYTES:].astype(np.float32)
            floats = (codes - params[..., 1:2]) * params[..., 0:1]
        else:
            n, heads = blocks.shape[:2]
            params = blocks[:, :, :_PARAM_BYTES, :].reshape(n, heads, _PARAM_BYTES * self.head_dim).copy()
            params = params.view(np.float32)
            scale, zero = params[..., None, : self.head_dim], params[..., None, self.head_dim :]
            floats = (blocks[:, :, _PARAM_BYTES:, :].astype(np.float32) - zero) * scale
        n, heads = floats.shape[:2]
        return floats.transpose(1, 0, 2, 3).reshape(heads, n * self.block_tokens, self.head_dim)[:, :length].copy()

    def quantize(self, kv: np.ndarray, num_blocks: int) -> np.ndarray:
        """u8 blocks ``[num_blocks, heads, rows, cols]`` holding ``kv`` ``[heads, T, head_dim]``
        (T ≤ num_blocks × block_tokens; the token rows past T hold code 0 and take no part in a
        block's parameters)."""
        heads, length, dim = kv.shape
        if dim != self.head_dim or length > num_blocks * self.block_tokens:
            raise UserError(f"cannot put KV of shape {kv.shape} into {num_blocks} blocks of "
                            f"{self.block_tokens} tokens × {self.head_dim} dims")
        padded = np.zeros((heads, num_blocks * self.block_tokens, dim), dtype=np.float32)
        padded[:, :length] = kv
        tokens = padded.reshape(heads, num_blocks, self.block_tokens, dim).transpose(1, 0, 2, 3)
        valid = (np.arange(num_blocks * self.block_tokens) < length).reshape(num_blocks, 1, self.block_tokens, 1)
        if self.kind == "by_token":
            scale, zero, codes = _affine(tokens, valid, axis=3)  # per token row
            params = np.concatenate([scale, zero], axis=3).astype(np.float32).view(np.uint8)
            return np.concatenate([params, codes], axis=3)
        scale, zero, codes = _affine(tokens, valid, axis=2)  # per channel over the block's tokens
        params = np.concatenate([scale, zero], axis=3).astype(np.float32)  # [n, heads, 1, 2*dim]
        param_rows = params.view(np.uint8).reshape(num_blocks, heads, _PARAM_BYTES, dim)
        return np.concatenate([param_rows, codes], axis=2)


def _affine(x: np.ndarray, valid: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-group scale and zero point over the ``valid`` entries along ``axis`` (keepdims), and
    the u8 codes (0 where not valid)."""
    low = np.where(valid, x, np.inf).min(axis=axis, keepdims=True)
    high = np.where(valid, x, -np.inf).max(axis=axis, keepdims=True)
    empty = ~np.isfinite(low)
    low, high = np.where(empty, 0.0, low), np.where(empty, 0.0, high)
    scale = (high - low) / _LEVELS
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    zero = (-low / scale).astype(np.float32)
    codes = np.clip(np.rint(x / scale + zero), 0, _LEVELS)
    return scale, zero, np.where(valid, codes, 0).astype(np.uint8)


def raw_block_layouts(keys: np.ndarray, values: np.ndarray, *, num_tokens: int,
                      block_tokens: int) -> tuple[BlockLayout, BlockLayout]:
    """The K and V layouts of a u8 cache's raw blocks ``[layers, blocks, heads, rows, cols]`` holding
    ``num_tokens``; ``UserError`` unless they are uint8 blocks of a known layout, just enough of them:
    ``key_layout, value_layout = raw_block_layouts(keys, values, num_tokens=40, block_tokens=32)``."""
    if keys.ndim != 5 or values.ndim != 5 or keys.shape[:3] != values.shape[:3]:
        raise UserError(f"raw blocks must be [layers, blocks, heads, rows, cols] with the same leading "
                        f"axes for K and V; got {keys.shape} and {values.shape}")
    if keys.dtype != np.uint8 or values.dtype != np.uint8:
        raise UserError(f"u8-paged snapshots store uint8 blocks, got {keys.dtype}/{values.dtype}")
    if keys.shape[1] != -(-num_tokens // block_tokens):
        raise UserError(f"{keys.shape[1]} blocks of {block_tokens} tokens do not hold exactly {num_tokens} tokens")
    return (BlockLayout.of(keys.shape[2:], block_tokens=block_tokens),
            BlockLayout.of(values.shape[2:], block_tokens=block_tokens))
