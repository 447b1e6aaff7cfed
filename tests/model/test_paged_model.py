"""The PagedAttention form of the default model (issue 15, first step): a paged model with
caller-owned KV blocks, a block pool, and a paged slot that KVLog runs on.

Exactness as measured here (f32 KV, exact numerics): any multi-token chunking equals a one-pass
prefill bit for bit on avx512 CPUs (within f32 rounding on avx2-only ones); a prefix shared by
block table (no copy) equals a cold prefill bit for bit;
paged vs stateful one-pass ~4e-5; two sequences in one step vs each alone ~5e-5.

The tests here run the real model; the scripted ones are in ``tests/test_paged.py``."""

from __future__ import annotations

import logging
from dataclasses import replace

import numpy as np
import pytest
from zoo_helpers import ZOO

from agentkv.engine.paged.block_pool import BlockPool, KVPoolExhausted
from agentkv.errors import UserError
from agentkv.kv.log import KVLog

pytestmark = pytest.mark.model


IDS = np.random.default_rng(0).integers(200, 40000, 400).tolist()
TINY = ZOO / "llama3_1"
"""A tiny random-weight model (tests/data/zoo): its three graphs compile in ~1 s against ~7 s for the
default model's, for the tests of how graphs are compiled, kept and handed on (not of what they compute)."""
TINY_IDS = np.random.default_rng(0).integers(3, 2000, 64).tolist()


def tiny_files():
    from agentkv.engine.openvino.models import resolve_model

    return resolve_model(TINY)


# ---- the paged model ---------------------------------------------------------------------------
class HeldBlocks:
    """A paged model seen through blocks the test holds: block ``i`` of a test's tables is the
    ``i``-th held block, so the tests write small fixed numbers and touch no one else's blocks."""

    def __init__(self, model, blocks: list[int]) -> None:
        self.model, self.blocks = model, blocks

    def step(self, steps):
        return self.model.step([replace(seq, blocks=[self.blocks[b] for b in seq.blocks]) for seq in steps])

    def step_alone(self, token: int, past_len: int, table: list[int], **options):
        return self.model.step_alone(token, past_len, [self.blocks[b] for b in table], **options)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


@pytest.fixture(scope="module")
def exact_paged(paged_exact):
    """The paged model of the session's ``paged_exact`` engine (f32 blocks, exact numerics: what a
    ``PagedModel(..., kv_cache_precision="f32", exact=True)`` computes) through 64 blocks held from
    its pool: where the session already built that engine, one compile of the default model's three
    graphs fewer (~15 s of CPU)."""
    pool, holder = paged_exact.block_pool, object()
    blocks = pool.allocate(64, holder=holder)
    try:
        yield HeldBlocks(paged_exact.paged_model, blocks)
    finally:
        pool.release(blocks)
        pool.unreserve(holder)


F32_CHUNKING_RELATIVE = 1e-5
"""Largest chunked-vs-one-pass logit difference, relative to the largest logit, where the CPU's
kernels sum in another order per chunk (measured on an AMD EPYC with avx2 only: 3.1e-5 max abs
on logits up to 25.7, 1.2e-6 relative; bit for bit on the avx512 CPUs measured)."""


def _cpu_has_avx512() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            return " avx512f" in info.read()
    except OSError:
        return False


def test_any_multi_token_chunking_equals_a_one_pass_prefill_bit_for_bit_on_avx512_and_within_rounding_on_avx2(
        exact_paged):
    from agentkv.engine.paged.model import SequenceStep

    one = exact_paged.step([SequenceStep(IDS[:100], 0, [0, 1, 2, 3])])
    exact_paged.step([SequenceStep(IDS[:37], 0, [4, 5, 6, 7])])
    chunked = exact_paged.step([SequenceStep(IDS[37:100], 37, [4, 5, 6, 7])])
    if _cpu_has_avx512():
        assert np.array_equal(one, chunked)
    else:  # avx2 kernels: float rounding only
        assert np.max(np.abs(one - chunked)) <= F32_CHUNKING_RELATIVE * np.max(np.abs(one))


async def test_a_paged_prefill_equals_the_stateful_engine_within_float_rounding(exact_paged, engine_f32):
    from agentkv.engine.paged.model import SequenceStep

    paged = exact_paged.step([SequenceStep(IDS[:100], 0, [0, 1, 2, 3])])[0]
    session = await engine_f32.open_session()  # exact numerics, no prefix cache: a one-pass prefill
    try:
        await session.prefill(IDS[:100])
        reference = await session.next_token_logits()
    finally:
        await session.close()
    assert np.abs(paged - reference).max() <= 1e-3


def test_a_prefix_shared_by_block_table_equals_a_cold_prefill_exactly(exact_paged):
    from agentkv.engine.paged.model import SequenceStep

    prefix = IDS[:64]  # two full blocks
    exact_paged.step([SequenceStep(prefix, 0, [10, 11])])
    shared = exact_paged.step([SequenceStep(IDS[64:90], 64, [10, 11, 12])])  # reads blocks 10, 11: no copy
    exact_paged.step([SequenceStep(prefix, 0, [20, 21])])
    cold = exact_paged.step([SequenceStep(IDS[64:90], 64, [20, 21, 22])])
    assert np.array_equal(shared, cold)


def test_sequences_stepped_together_match_each_alone(exact_paged):
    from agentkv.engine.paged.model import SequenceStep

    alone = [exact_paged.step([SequenceStep(IDS[:70], 0, [30, 31, 32])])[0],
             exact_paged.step([SequenceStep(IDS[100:140], 0, [33, 34])])[0]]
    together = exact_paged.step([SequenceStep(IDS[:70], 0, [35, 36, 37]), SequenceStep(IDS[100:140], 0, [38, 39])])
    assert max(np.abs(together[i] - alone[i]).max() for i in range(2)) <= 1e-3


def test_one_token_steps_small_steps_and_chunks_on_their_own_graphs_give_the_logits_of_one_graph(exact_paged):
    """The default model is small enough for a chunk and a small-step graph; the three graphs step
    the same blocks, so decode steps read the KV chunks wrote and the other way round, bit for bit."""
    from agentkv.engine.openvino.models import resolve_model
    from agentkv.engine.paged.model import PagedModel, SequenceStep

    assert exact_paged.wait_for_graphs() == 3
    single = PagedModel(resolve_model(None), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=False)
    assert single.graphs == 1
    a, b = [0, 1, 2], [3, 4, 5]
    script = [  # prefill, decode, a verify of 5 rows, decode, a forced chunk (small), two sequences decoding
        [SequenceStep(IDS[:50], 0, a)], [SequenceStep(IDS[50:51], 50, a)],  # together, a small verify
        [SequenceStep(IDS[51:56], 51, a, last_rows=5)], [SequenceStep(IDS[56:57], 56, a)],
        [SequenceStep(IDS[57:60], 57, a)], [SequenceStep(IDS[200:240], 0, b)],
        [SequenceStep(IDS[60:61], 60, a), SequenceStep(IDS[240:241], 40, b)],
        [SequenceStep(IDS[61:65], 61, a, last_rows=4)], [SequenceStep(IDS[65:66], 65, a)],
    ]
    for step in script:
        shifted = [replace(seq, blocks=[40 + block for block in seq.blocks]) for seq in step]
        assert np.array_equal(exact_paged.step(shifted), single.step(step))
    ran = {name: tuple(getattr(exact_paged, f"_{name}_request").request.get_tensor("input_ids").shape)
           for name in ("decode", "small", "chunk")}  # noqa: SLF001 - which graph ran which step?
    assert ran == {"decode": (1,), "small": (4,), "chunk": (40,)}


def test_the_graphs_compile_without_the_blob_cache_and_leave_the_process_locale_as_it_was(
        tmp_path, private_compiled_pool):
    """Compiled in parallel, with ``CACHE_DIR`` dropped: it cannot hold paged graphs, and its hashing
    switches the process to the C locale, which overlapping compiles can leave behind (Python's
    ``open()`` then decodes files as ASCII)."""
    import locale

    from agentkv.engine.paged.model import PagedModel

    _, compiles = private_compiled_pool
    before = locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)
    # the zoo's tiny model: the same three graphs, compiled in a twentieth of the default model's CPU
    model = PagedModel(tiny_files(), num_blocks=4, chunk_graph=True, ov_config={"CACHE_DIR": str(tmp_path)})
    assert model.wait_for_graphs() == len(compiles) == 3 and not any(tmp_path.iterdir())
    assert (locale.setlocale(locale.LC_ALL), locale.getpreferredencoding(False)) == before


def test_a_block_table_padded_to_its_bucket_gives_the_logits_of_the_bare_table_bit_for_bit(exact_paged, monkeypatch):
    import agentkv.engine.paged.model as paged_model
    from agentkv.engine.paged.model import SequenceStep

    two = [[40, 41, 42], [43, 44, 45]]  # 3 blocks each: padded to 8 (one sequence) and 8 (both)
    exact_paged.step([SequenceStep(IDS[:70], 0, two[0]), SequenceStep(IDS[100:170], 0, two[1])])
    steps = [SequenceStep(IDS[70:72], 70, two[0], last_rows=2), SequenceStep(IDS[170:171], 70, two[1])]
    padded = exact_paged.step(steps)
    monkeypatch.setattr(paged_model, "padded_table", lambda blocks: blocks)
    assert np.array_equal(exact_paged.step(steps), padded)


def test_step_alone_calls_while_running_once_during_the_step_and_a_raise_leaves_the_next_step_whole(exact_paged):
    from agentkv.engine.paged.model import SequenceStep

    table = [60, 61]
    exact_paged.step([SequenceStep(IDS[:40], 0, table)])
    greedy, row = exact_paged.step_alone(IDS[40], 40, table)
    row = row.copy()
    request = exact_paged._alone_request.request  # noqa: SLF001 - is the step still computing?
    calls: list[bool] = []
    got, got_row = exact_paged.step_alone(IDS[40], 40, table, while_running=lambda: calls.append(request.wait_for(0)))
    assert calls == [False] and got == greedy == int(np.argmax(row)) and np.array_equal(got_row, row)

    def fails() -> None:
        raise RuntimeError("while the step ran")

    with pytest.raises(RuntimeError, match="while the step ran"):
        exact_paged.step_alone(IDS[40], 40, table, while_running=fails)
    again, again_row = exact_paged.step_alone(IDS[40], 40, table)
    assert again == greedy and np.array_equal(again_row, row)


@pytest.mark.parametrize(("failing", "graphs"), [("chunk", 1), ("small", 2)])
def test_when_an_extra_graph_fails_to_compile_the_graphs_before_it_run_its_steps_and_a_warning_says_so(
        monkeypatch, caplog, failing, graphs):
    import agentkv.engine.paged.graphs as paged_graphs
    import agentkv.engine.paged.model as paged_model
    from agentkv.engine.paged.compiled_pool import CompiledPool
    from agentkv.engine.paged.model import PagedModel, SequenceStep
    from agentkv.errors import ModelCompileFailed

    compiles = []
    real = paged_graphs.compile_for_device

    def one_fails(core, model, *args, **kwargs):
        compiles.append(model.get_friendly_name())
        if model.get_friendly_name().endswith(f"({failing} steps)"):
            raise ModelCompileFailed("out of memory (a test)")
        return real(core, model, *args, **kwargs)

    monkeypatch.setattr(paged_model, "COMPILED", CompiledPool())  # compile, do not reuse
    reference = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=True)
    monkeypatch.setattr(paged_model, "COMPILED", CompiledPool())  # nor share the reference's live graphs
    monkeypatch.setattr(paged_graphs, "compile_for_device", one_fails)
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.paged.graphs"):
        model = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=True)
        assert model.wait_for_graphs() == graphs  # the warning comes from the thread that compiled
    assert reference.wait_for_graphs() == 3
    assert len(compiles) == 3 and f"{failing} graph failed" in caplog.text
    for begin, end in [(0, 40), (40, 41), (41, 44), (44, 45)]:  # prefill, decode, a small step, decode
        step = [SequenceStep(TINY_IDS[begin:end], begin, [0, 1], last_rows=end - begin)]
        assert np.array_equal(model.step(step), reference.step(step))


def test_a_released_models_graphs_open_the_next_one_on_the_same_settings_without_compiling(
        monkeypatch, private_compiled_pool):
    """``AGENTKV_KEEP_COMPILED``: the graphs of a released model (a closed engine) run the next
    model on the same files and settings: no compile, the same logits bit for bit; a model on
    other settings compiles its own; the released one refuses to step."""
    from agentkv.engine.paged.compiled_pool import KEEP_ENV
    from agentkv.engine.paged.model import PagedModel, SequenceStep

    pool, compiles = private_compiled_pool
    monkeypatch.setenv(KEEP_ENV, "3")
    first = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=True)
    prefill, decode = [SequenceStep(TINY_IDS[:40], 0, [0, 1])], [SequenceStep(TINY_IDS[40:41], 40, [0, 1])]
    expected = [first.step(prefill), first.step(decode)]
    assert first.wait_for_graphs() == len(compiles) == 3
    first.release()
    first.release()  # once is enough
    assert pool.idle_graphs() == 3 and first.graphs == 0
    with pytest.raises(UserError, match="released"):
        first.step(decode)
    second = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=True)
    assert len(compiles) == 3 and second.graphs == 3 and pool.idle_graphs() == 0
    assert np.array_equal(second.step(prefill), expected[0]) and np.array_equal(second.step(decode), expected[1])
    other = PagedModel(tiny_files(), num_blocks=8, kv_cache_precision="f32", exact=True, chunk_graph=False)
    assert len(compiles) == 4 and other.graphs == 1
    monkeypatch.setenv(KEEP_ENV, "0")
    second.release()
    assert pool.idle_graphs() == 0


def test_small_graph_without_the_chunk_graph_is_refused_before_anything_compiles(private_compiled_pool):
    from agentkv.engine.openvino.models import resolve_model
    from agentkv.engine.paged.model import PagedModel

    _, compiles = private_compiled_pool
    with pytest.raises(UserError, match="small_graph=True needs the chunk graph"):
        PagedModel(resolve_model(None), num_blocks=4, chunk_graph=False, small_graph=True)
    assert compiles == []


def test_a_model_dropped_in_a_reference_cycle_without_release_gives_its_graphs_to_the_next_one(
        monkeypatch, private_compiled_pool):
    from agentkv.engine.paged.compiled_pool import KEEP_ENV
    from agentkv.engine.paged.model import PagedModel

    _, compiles = private_compiled_pool
    monkeypatch.setenv(KEEP_ENV, "1")
    dropped = PagedModel(tiny_files(), num_blocks=4, kv_cache_precision="f32", exact=True, chunk_graph=False)
    dropped.cycle = dropped  # type: ignore[attr-defined]  # as an engine and its backend refer to each other
    del dropped
    again = PagedModel(tiny_files(), num_blocks=4, kv_cache_precision="f32", exact=True, chunk_graph=False)
    assert len(compiles) == 1 and again.graphs == 1


# ---- KVLog on a paged slot ------------------------------------------------------------------
def test_kvlog_runs_on_a_paged_slot_trim_refeed_and_restore_stay_exact(exact_paged):
    from agentkv.engine.paged.slot import PagedSlot
    from agentkv.kv.snapshot import KVSnapshot

    pool = BlockPool(exact_paged.num_blocks)
    slot, log = PagedSlot(exact_paged, pool), KVLog()
    log.feed(slot, IDS[:50])
    log.feed(slot, IDS[50:90])
    reference = log.last_logits.copy()
    log.trim(slot, 50)
    log.check_integrity(slot)
    assert len(slot.blocks) == 2 and pool.free_blocks == exact_paged.num_blocks - 2
    assert np.array_equal(log.feed(slot, IDS[50:90]), reference)  # same cuts, same logits
    snapshot = KVSnapshot.from_float(log.tokens, *log.read(slot), fingerprint="paged")
    other = KVLog()
    restored = PagedSlot(exact_paged, pool)
    other.load(restored, snapshot, exact=True)
    other.trim(restored, 89)
    assert np.array_equal(other.feed(restored, IDS[89:90]), _refeed_last(log, slot))
    for s in (slot, restored):
        s.reset()
    assert pool.free_blocks == exact_paged.num_blocks
    pool.check_integrity()


def _refeed_last(log: KVLog, slot) -> np.ndarray:
    last = log.tokens[-1]
    log.trim(slot, len(log) - 1)
    return log.feed(slot, [last])


def test_a_paged_slot_refuses_what_it_cannot_do(exact_paged):
    from agentkv.engine.paged.slot import PagedSlot

    slot = PagedSlot(exact_paged, BlockPool(4))
    with pytest.raises(UserError, match="beam_idx"):
        slot.feed(np.array([[1], [2]]), 0, np.array([0, 3]))  # there is no row 3 to continue
    with pytest.raises(UserError, match="past_len"):
        slot.feed(np.array([[1]]), 5)
    with pytest.raises(KVPoolExhausted):
        slot.feed(np.array([IDS[:200]]), 0)
    assert slot.length() == 0 and slot.blocks == []
