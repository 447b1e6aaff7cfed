"""u8 KV blocks on the paged engine: the plugin's block layouts read and written with numpy,
snapshots and offload as raw blocks that restore bit for bit at u8 size.

The tests here run the real model; the scripted ones are in ``tests/test_paged_u8.py``."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv import GenerationConfig
from agentkv.errors import SnapshotIncompatible
from agentkv.kv.snapshot import RAW_BLOCKS, KVSnapshot

pytestmark = pytest.mark.model


CFG = GenerationConfig(max_new_tokens=10)


# ---- on the real model -----------------------------------------------------------------
@pytest.fixture(scope="module")
def paged_u8():
    from agentkv.engine.paged.engine import PagedEngine

    engine = PagedEngine(num_slots=1, kv_cache_precision="u8", kv_cache_bytes=48 << 20, prefix_cache_bytes=0)
    yield engine
    engine.block_pool.check_integrity()


def follow_up(engine) -> list[int]:
    return engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True))


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


async def test_a_fork_on_u8_blocks_shares_them_and_stays_exact(paged_u8):
    parent = await paged_u8.open_session()
    ids = prompt(paged_u8, "Tell me one fact about owls.")
    await parent.prefill(ids)
    child = await parent.fork()
    result = await child.generate(ids + follow_up(paged_u8), CFG)
    assert result.metrics.reused_tokens == len(ids) and child.kv_exact and result.metrics.kv_exact
    await child.close()
    await parent.close()


def test_u8_blocks_stepped_on_three_graphs_give_the_logits_of_one_graph(paged_u8):
    """Verifies and chunks on the chunk and small graphs and decode steps on the first read and write
    the same u8 blocks (the plugin quantises a block as tokens join it): the logits of one graph, bit
    for bit."""
    from agentkv.engine.openvino.models import resolve_model
    from agentkv.engine.paged.model import PagedModel, SequenceStep

    three = paged_u8.paged_model
    assert three.wait_for_graphs() == 3
    one = PagedModel(resolve_model(None), num_blocks=8, kv_cache_precision="u8", chunk_graph=False)
    assert one.block_shapes == three.block_shapes
    ids = np.random.default_rng(1).integers(200, 40000, 80).tolist()
    blocks = paged_u8.block_pool.allocate(3)  # blocks of the engine no session holds
    try:
        for past, end, rows in [(0, 40, 1), (40, 41, 1), (41, 46, 5), (46, 47, 1), (47, 50, 1), (50, 51, 1),
                                 (51, 55, 4), (55, 56, 1)]:
            mine = three.step([SequenceStep(ids[past:end], past, blocks, last_rows=rows)])
            assert np.array_equal(mine, one.step([SequenceStep(ids[past:end], past, [0, 1, 2], last_rows=rows)]))
    finally:
        paged_u8.block_pool.release(blocks)
