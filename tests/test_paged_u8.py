"""u8 KV blocks on the paged engine: the plugin's block layouts read and written with numpy,
snapshots and offload as raw blocks that restore bit for bit at u8 size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.snapshot import RAW_BLOCKS, KVSnapshot
from agentkv.kv.u8_blocks import BlockLayout
from agentkv.errors import SnapshotIncompatible, UserError


# ---- the block codec (no model) ------------------------------------------------------
@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["by_token", "by_channel"]), length=st.integers(1, 70),
       seed=st.integers(0, 2**16), spread=st.floats(0.01, 50.0))
def test_quantised_blocks_dequantise_within_half_a_step_of_each_group(kind, length, seed, spread):
    rng = np.random.default_rng(seed)
    heads, dim, tokens = 2, 8, 32
    layout = BlockLayout(kind, tokens, dim)
    kv = (rng.standard_normal((heads, length, dim)) * spread).astype(np.float32)
    num_blocks = -(-length // tokens)
    blocks = layout.quantize(kv, num_blocks)
    expected_shape = (tokens, dim + 8) if kind == "by_token" else (tokens + 8, dim)
    assert blocks.dtype == np.uint8 and blocks.shape == (num_blocks, heads, *expected_shape)
    assert BlockLayout.of(blocks.shape[1:], block_tokens=tokens) == layout
    back = layout.dequantize(blocks, length)
    assert back.shape == kv.shape
    # the step of each group: a token row (by token) or a channel within one block (by channel)
    if kind == "by_token":
        step = np.ptp(kv, axis=2, keepdims=True) / 255
    else:
        step = np.concatenate([np.broadcast_to(np.ptp(kv[:, b:b + tokens], axis=1, keepdims=True) / 255,
                                               kv[:, b:b + tokens].shape) for b in range(0, length, tokens)], axis=1)
    assert np.all(np.abs(back - kv) <= 0.5 * step + 1e-5 * (1 + np.abs(kv)))


def test_a_block_shape_of_no_known_layout_is_refused_with_what_to_do():
    with pytest.raises(UserError, match="kv_cache_precision='f16'"):
        BlockLayout.of((3, 33, 64), block_tokens=32)


def test_a_raw_block_snapshot_round_trips_through_a_file_and_cuts_to_a_prefix(tmp_path):
    rng = np.random.default_rng(1)
    kv = rng.standard_normal((2, 1, 70, 8)).astype(np.float32)
    keys = np.stack([BlockLayout("by_channel", 32, 8).quantize(layer, 3) for layer in kv])
    values = np.stack([BlockLayout("by_token", 32, 8).quantize(layer, 3) for layer in kv])
    assert keys.shape == (2, 3, 1, 40, 8) and values.shape == (2, 3, 1, 32, 16)
    snap = KVSnapshot.from_blocks(range(70), keys, values, block_tokens=32, fingerprint="fp")
    assert snap.precision == RAW_BLOCKS and snap.num_tokens == 70
    snap.to_file(tmp_path / "s.kv")
    back = KVSnapshot.from_file(tmp_path / "s.kv", expected_fingerprint="fp")
    assert back.checksum() == snap.checksum()
    assert np.array_equal(back.keys, keys) and np.array_equal(back.values, values)
    cut = back.prefix(33)
    assert cut.keys.shape[1] == 2 and cut.tokens == tuple(range(33))
    float_keys, float_values = back.to_float()
    assert float_keys.shape == float_values.shape == (2, 1, 1, 70, 8)
    assert np.abs(float_keys[:, 0] - kv).max() < 0.05 and np.abs(float_values[:, 0] - kv).max() < 0.05
    with pytest.raises(UserError, match="do not hold exactly"):
        KVSnapshot.from_blocks(range(100), keys, values, block_tokens=32, fingerprint="fp")


def test_raw_blocks_are_refused_by_a_slot_that_takes_only_floats():
    kv = np.ones((1, 2, 8), np.float32)
    keys = BlockLayout("by_channel", 32, 8).quantize(kv, 1)[None]
    values = BlockLayout("by_token", 32, 8).quantize(kv, 1)[None]
    snap = KVSnapshot.from_blocks([1, 2], keys, values, block_tokens=32, fingerprint="fp")

    class FloatSlot:
        def write(self, keys, values):
            raise AssertionError("raw blocks must not be written as floats")

    with pytest.raises(SnapshotIncompatible, match="re-prefill"):
        snap.write_into(FloatSlot())


def test_empty_blocks_dequantise_to_no_tokens_in_either_layout():
    for layout, shape in ((BlockLayout("by_token", 32, 8), (32, 16)), (BlockLayout("by_channel", 32, 8), (40, 8))):
        assert layout.dequantize(np.zeros((0, 2, *shape), np.uint8), 0).shape == (2, 0, 8)


def test_raw_block_files_and_float_files_are_written_in_the_current_format(tmp_path):
    from agentkv.kv.snapshot_file import FORMAT_VERSION, read_payload

    kv = np.ones((1, 3, 8), np.float32)
    raw = KVSnapshot.from_blocks(range(3), BlockLayout("by_channel", 32, 8).quantize(kv, 1)[None],
                                 BlockLayout("by_token", 32, 8).quantize(kv, 1)[None], block_tokens=32,
                                 fingerprint="fp")
    floats = KVSnapshot.from_float(range(3), kv[None, None], kv[None, None], fingerprint="fp")
    for snap in (raw, floats):  # NOTE: files before safetensors said 2 and 1 (tests/test_snapshot.py reads them)
        snap.to_file(tmp_path / "s.kv")
        assert read_payload(tmp_path / "s.kv").header["format_version"] == FORMAT_VERSION
    with pytest.raises(UserError, match="uint8"):
        KVSnapshot.from_blocks(range(3), raw.keys.astype(np.float16), raw.values, block_tokens=32, fingerprint="fp")


