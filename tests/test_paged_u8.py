"""u8 KV blocks on the paged engine: the plugin's block layouts read and written with numpy,
snapshots and offload as raw blocks that restore bit for bit at u8 size."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import GenerationConfig
from agentkv.engine.snapshot import RAW_BLOCKS, KVSnapshot
from agentkv.engine.u8_blocks import BlockLayout
from agentkv.errors import SnapshotIncompatible, UserError

CFG = GenerationConfig(max_new_tokens=10)


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


# ---- on the real model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def paged_u8():
    from agentkv.engine.paged import PagedEngine

    engine = PagedEngine(num_slots=1, kv_cache_precision="u8", kv_cache_bytes=48 << 20, prefix_cache_bytes=0)
    yield engine
    engine.block_pool.check_integrity()


def follow_up(engine) -> list[int]:
    return engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True))


@pytest.mark.model
async def test_u8_blocks_dequantise_to_the_kv_an_f16_cache_holds_within_a_quantisation_step(paged_u8, paged_engine):
    ids = prompt(paged_u8, "Name three rivers of Europe and say which is the longest, in detail please.")
    held = []
    for engine in (paged_u8, paged_engine):
        session = await engine.open_session()
        await session.prefill(ids)
        async with engine.pool.lease(session) as slot:
            held.append(slot.read())
        await session.close()
    (k8, v8), (k16, v16) = held
    assert k8.shape == k16.shape and v8.shape == v16.shape
    for u8, f16 in ((k8, k16), (v8, v16)):
        spread = float(np.ptp(f16))
        # a misread layout is off by the whole range; a quantisation step is 1/255 of a group's
        # range (plus the two caches' own compute noise: measured here, not assumed)
        assert np.abs(u8 - f16).max() < 0.05 * spread
        assert np.abs(u8 - f16).mean() < 0.005 * spread


@pytest.mark.model
async def test_a_u8_paged_snapshot_is_the_raw_blocks_and_restores_bit_for_bit(paged_u8, tmp_path):
    steady = await paged_u8.open_session()
    await steady.generate(prompt(paged_u8, "Tell me one fact about bees."), CFG)
    snap = await steady.snapshot()
    assert snap.precision == RAW_BLOCKS and snap.lossless
    assert snap.bytes_per_token == paged_u8.kv_bytes_per_token()
    f16_bytes = 2 * paged_u8.num_layers * 3 * 64 * 2
    assert snap.bytes_per_token < 0.6 * f16_bytes
    snap.to_file(tmp_path / "bees.kv")
    # NOTE: compare a next turn, not the last logits: a restore does not carry them, and
    # recomputing them re-feeds the last token into a block whose u8 keys are re-quantised
    second = list(snap.tokens) + follow_up(paged_u8)
    expected = await steady.generate(second, CFG)
    expected_logits = await steady.next_token_logits()
    await steady.close()

    restored = await paged_u8.open_session()
    await restored.restore(KVSnapshot.from_file(tmp_path / "bees.kv", expected_fingerprint=paged_u8.fingerprint))
    assert restored.kv_exact and list(restored.tokens) == list(snap.tokens)
    again = await restored.generate(second, CFG)
    assert again.token_ids == expected.token_ids
    assert np.array_equal(await restored.next_token_logits(), expected_logits)
    await restored.close()


@pytest.mark.model
async def test_an_offloaded_u8_paged_session_comes_back_bit_for_bit(paged_u8):
    first = prompt(paged_u8, "Tell me one fact about glass.")
    steady = await paged_u8.open_session()
    one = await steady.generate(first, CFG)
    second = list(steady.tokens) + list(one.token_ids[-1:]) + follow_up(paged_u8)
    expected = await steady.generate(second, CFG)
    expected_logits = await steady.next_token_logits()
    await steady.close()

    moved = await paged_u8.open_session()
    await moved.generate(first, CFG)
    other = await paged_u8.open_session()  # one slot: the first session goes to host memory
    await other.generate(prompt(paged_u8, "Tell me one fact about rivers."), CFG)
    assert not paged_u8.pool.is_bound(moved)
    again = await moved.generate(second, CFG)
    assert again.token_ids == expected.token_ids and moved.kv_exact
    assert np.array_equal(await moved.next_token_logits(), expected_logits)
    await other.close()
    await moved.close()


@pytest.mark.model
async def test_a_dropped_span_on_u8_blocks_re_quantises_the_rest_and_the_session_goes_on(paged_u8):
    session = await paged_u8.open_session()
    ids = prompt(paged_u8, "Tell me about the history of the printing press in Europe, with dates.")
    await session.generate(ids, CFG)
    length = len(session.tokens)
    await session.drop(5, 45)
    assert len(session.tokens) == length - 40 and session.shifted
    result = await session.generate(list(session.tokens) + paged_u8.tokenizer.encode(" More."), CFG)
    assert len(result.token_ids) > 0
    await session.check_integrity()
    await session.close()


def test_empty_blocks_dequantise_to_no_tokens_in_either_layout():
    for layout, shape in ((BlockLayout("by_token", 32, 8), (32, 16)), (BlockLayout("by_channel", 32, 8), (40, 8))):
        assert layout.dequantize(np.zeros((0, 2, *shape), np.uint8), 0).shape == (2, 0, 8)


def test_raw_block_files_say_format_2_and_float_files_stay_format_1(tmp_path):
    import struct

    kv = np.ones((1, 3, 8), np.float32)
    raw = KVSnapshot.from_blocks(range(3), BlockLayout("by_channel", 32, 8).quantize(kv, 1)[None],
                                 BlockLayout("by_token", 32, 8).quantize(kv, 1)[None], block_tokens=32, fingerprint="fp")
    floats = KVSnapshot.from_float(range(3), kv[None, None], kv[None, None], fingerprint="fp")
    for snap, version in ((raw, 2), (floats, 1)):
        snap.to_file(tmp_path / "s.kv")
        assert struct.unpack("<8sII", (tmp_path / "s.kv").read_bytes()[:16])[1] == version
    with pytest.raises(UserError, match="uint8"):
        KVSnapshot.from_blocks(range(3), raw.keys.astype(np.float16), raw.values, block_tokens=32, fingerprint="fp")


@pytest.mark.model
async def test_u8_fingerprints_carry_the_block_layout_and_a_foreign_layout_is_refused(paged_u8):
    key, value = paged_u8.paged_model.block_shapes
    assert paged_u8.fingerprint.endswith(f":paged:{'x'.join(map(str, key))}/{'x'.join(map(str, value))}")
    session = await paged_u8.open_session()
    await session.prefill(prompt(paged_u8, "Hello there."))
    snap = await session.snapshot()
    # keys laid out by token (as on a CPU whose plugin does that), under this engine's fingerprint
    foreign = KVSnapshot.from_blocks(snap.tokens, snap.values, snap.values, block_tokens=32,
                                     fingerprint=paged_u8.fingerprint)
    with pytest.raises(SnapshotIncompatible, match="re-prefill"):
        await session.restore(foreign)
    await session.restore(snap)  # the session is usable again from its own snapshot
    assert list(session.tokens) == list(snap.tokens)
    await session.close()


@pytest.mark.model
async def test_a_fork_on_u8_blocks_shares_them_and_stays_exact(paged_u8):
    parent = await paged_u8.open_session()
    ids = prompt(paged_u8, "Tell me one fact about owls.")
    await parent.prefill(ids)
    child = await parent.fork()
    result = await child.generate(ids + follow_up(paged_u8), CFG)
    assert result.metrics.reused_tokens == len(ids) and child.kv_exact and result.metrics.kv_exact
    await child.close()
    await parent.close()
