"""Every KV knows where the passes that computed it began: KVLog keeps ``cuts`` in step with its
tokens through feeds, runs, trims, drops, loads and beam collapses, and snapshots carry them
through files, prefixes, spans and joins. A fake slot stands in for the model; its "KV" records,
per position, whether a pass began there, so the log's cuts are checked against what the slot
really computed."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_paged_prefix import FakePagedModel

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.prefix.radix import PrefixCache
from agentkv.errors import SnapshotCorrupt, UserError
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog
from agentkv.kv.rope import RopeConvention
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kv.snapshot_cuts import checked_cuts, join_cuts, span_cuts

VOCAB = 16
NO_ROPE = RopeConvention("none", (), None, None, 0.0)


class PassSlot:
    """One row of fake KV: per position its token (keys) and 1.0 where a pass began (values).
    ``feed_run`` steps one token per pass, as the paged slot's run does; ``fail_after`` makes
    the run raise after that many steps (the tokens fed stay fed)."""

    def __init__(self, *, runs: bool = False) -> None:
        self.tokens: list[int] = []
        self.began: list[bool] = []
        self.fail_after: int | None = None
        if not runs:
            self.feed_run = None  # type: ignore[assignment]  # a slot without runs: one feed per token

    def _logits(self) -> np.ndarray:
        return np.eye(VOCAB, dtype=np.float32)[self.tokens[-1] % VOCAB]

    def feed(self, input_ids, past_len, beam_idx=None, position_offset=0):
        ids = [int(t) for t in np.asarray(input_ids)[0]]
        assert past_len == len(self.tokens), (past_len, len(self.tokens))
        self.tokens.extend(ids)
        self.began.extend([True] + [False] * (len(ids) - 1) if ids else [])
        return self._logits()[None, :]

    def feed_rows(self, input_ids, past_len, rows):
        self.feed(input_ids, past_len)
        return np.stack([self._logits()] * rows)

    def feed_run(self, token, past_len, *, steps, choose, ends, chosen, greedy=False, started=None):
        assert past_len == len(self.tokens)
        for step in range(steps):
            if self.fail_after is not None and step == self.fail_after:
                raise RuntimeError("device lost")
            self.feed(np.array([[token]]), len(self.tokens))
            token = choose(self._logits())
            chosen.append(token)
            if ends(token):
                break
        return self._logits()

    def length(self):
        return len(self.tokens)

    def reset(self):
        self.tokens, self.began = [], []

    def trim(self, n):
        del self.tokens[n:], self.began[n:]

    def read(self):
        keys = np.array(self.tokens, dtype=np.float32)[None, None, None, :, None]
        values = np.array(self.began, dtype=np.float32)[None, None, None, :, None]
        return keys, values

    def write(self, keys, values):
        self.tokens = [int(k) for k in keys[0, 0, 0, :, 0]]
        self.began = [bool(v) for v in values[0, 0, 0, :, 0]]

    def select_row(self, row, n):
        assert row == 0
        self.trim(n)

    def computed_cuts(self) -> list[int]:
        """Where the passes that computed the held KV began (0 left out, as the log does)."""
        return [p for p in range(1, len(self.tokens)) if self.began[p]]


def snapshot_of(log: KVLog, slot: PassSlot) -> KVSnapshot:
    keys, values = log.read(slot)
    return KVSnapshot.from_float(log.tokens, keys, values, fingerprint="fake", shifted=log.shifted, cuts=log.cuts)


# ---- KVLog -------------------------------------------------------------------------------
def test_a_prefill_records_each_canonical_chunk_start_and_a_greedy_run_each_token():
    boundaries = PrefixBoundaries()
    boundaries.register([1, 2, 3])
    slot, log = PassSlot(runs=True), KVLog(boundaries=boundaries, chunk_size=4)
    log.feed(slot, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert log.cuts == [3, 4, 8]
    chosen = log.feed_run(slot, [9, 10], steps=3, choose=lambda logits: 11, ends=lambda t: False)
    assert chosen == [11, 11, 11]  # [9, 10] go in as one pass, then 11 and 11 one step each
    assert log.cuts == [3, 4, 8, 9, 11, 12] == slot.computed_cuts()


def test_a_failed_run_keeps_the_cuts_of_the_tokens_it_fed():
    slot, log = PassSlot(runs=True), KVLog()
    log.feed(slot, [1, 2, 3])
    slot.fail_after = 2
    with pytest.raises(RuntimeError):
        log.feed_run(slot, [4], steps=5, choose=lambda logits: 7, ends=lambda t: False)
    assert log.tokens == [1, 2, 3, 4, 7] and log.cuts == [3, 4] == slot.computed_cuts()


def test_a_draft_verification_is_one_pass_cut_at_its_start():
    slot, log = PassSlot(), KVLog()
    log.feed(slot, [1, 2, 3])
    rows = log.feed_rows(slot, [4, 5, 6], 3)
    assert rows.shape == (3, VOCAB) and log.cuts == [3]
    log.trim(slot, 4)  # the model refused 5 and 6
    log.feed(slot, [8])
    assert log.cuts == [3, 4] == slot.computed_cuts()


def test_a_drop_removes_the_cuts_inside_the_span_moves_later_ones_and_cuts_at_its_start():
    slot, log = PassSlot(), KVLog(chunk_size=4)
    log.feed(slot, list(range(1, 11)))  # cuts 4, 8
    log.feed(slot, [11])  # cut 10
    log.drop(slot, 3, 6, NO_ROPE)
    assert log.tokens == [1, 2, 3, 7, 8, 9, 10, 11] and log.cuts == [3, 5, 7]


def test_loading_takes_the_sources_cuts_and_an_old_snapshot_leaves_them_unknown():
    slot, log = PassSlot(), KVLog(chunk_size=4)
    log.feed(slot, list(range(1, 7)))
    snapshot = snapshot_of(log, slot)
    other_slot, other = PassSlot(), KVLog()
    other.load(other_slot, snapshot, exact=True)
    assert other.cuts == [4] == other_slot.computed_cuts()
    unknown = KVSnapshot.from_float(snapshot.tokens, *log.read(slot), fingerprint="fake")
    other.load(other_slot, unknown, exact=True)
    assert other.cuts is None
    other.feed(other_slot, [9])  # more KV on unknown KV: still unknown
    other.trim(other_slot, 3)
    assert other.cuts is None
    other.trim(other_slot, 0)  # empty: known again
    other.feed(other_slot, [1, 2])
    assert other.cuts == []


def test_beam_steps_are_one_token_passes_and_the_collapsing_feed_is_one_more():
    slot, log = PassSlot(), KVLog()
    log.feed(slot, [1, 2])
    prompt = list(log.tokens)
    slot.feed(np.array([[3]]), 2)  # beam steps: one token a pass, the log waits
    slot.feed(np.array([[4]]), 3)
    log.collapse_feeding(slot, 0, [3, 4], [5, 6])
    assert log.tokens == [1, 2, 3, 4, 5, 6] and log.cuts == [2, 3, 4] == slot.computed_cuts()
    log.trim(slot, 2)
    slot.feed(np.array([[3]]), 2)
    log.collapse(slot, 0, [*prompt, 3])
    assert log.tokens == [1, 2, 3] and log.cuts == [2] == slot.computed_cuts()
    log.collapse(slot, 0, prompt)  # back to the prompt (a cancelled search)
    assert log.cuts == []


operation = st.one_of(
    st.tuples(st.just("feed"), st.lists(st.integers(1, 15), min_size=1, max_size=9)),
    st.tuples(st.just("run"), st.integers(1, 4), st.integers(0, 4)),
    st.tuples(st.just("trim"), st.integers(0, 14)),
    st.tuples(st.just("drop"), st.integers(0, 14), st.integers(0, 4)),
    st.tuples(st.just("reload"),),
)


def apply(log: KVLog, slot: PassSlot, op: tuple) -> None:
    """One operation on the log, the fake slot's record of pass starts kept as the model's."""
    if op[0] == "feed":
        log.feed(slot, op[1])
    elif op[0] == "run" and log.tokens:
        slot.fail_after = op[2] if op[2] < op[1] else None
        try:
            log.feed_run(slot, [log.tokens[-1] % 7 + 1], steps=op[1], choose=lambda logits: 5, ends=lambda t: False)
        except RuntimeError:
            pass
        slot.fail_after = None
    elif op[0] == "trim":
        log.trim(slot, op[1])
    elif op[0] == "drop" and log.tokens:
        start = min(op[1], len(log))
        end = min(len(log), start + op[2])
        log.drop(slot, start, end, NO_ROPE)
        if start < end and start < len(slot.began):
            slot.began[start] = True  # the KV after a dropped span is rewritten: a pass of its own
    elif op[0] == "reload":
        log.load(slot, snapshot_of(log, slot), exact=True)


@settings(max_examples=80, deadline=None)
@given(ops=st.lists(operation, max_size=14))
def test_the_cuts_are_always_where_the_held_kvs_passes_began(ops):
    boundaries = PrefixBoundaries()
    boundaries.register([1, 2, 3])
    slot, log = PassSlot(runs=True), KVLog(boundaries=boundaries, chunk_size=4)
    for op in ops:
        apply(log, slot, op)
        assert log.cuts is not None
        assert log.cuts == sorted(set(log.cuts)) and all(0 < c < len(log) for c in log.cuts)
        assert log.cuts == slot.computed_cuts() and log.tokens == slot.tokens


@settings(max_examples=60, deadline=None)
@given(feeds=st.lists(st.lists(st.integers(1, 15), min_size=1, max_size=9), min_size=1, max_size=5),
       back=st.integers(0, 5), runs=st.booleans())
def test_a_trim_then_the_same_feeds_give_the_same_cuts(feeds, back, runs):
    boundaries = PrefixBoundaries()
    boundaries.register(feeds[0][:3])
    slot, log = PassSlot(runs=runs), KVLog(boundaries=boundaries, chunk_size=4)
    ends = []
    for ids in feeds:
        log.feed(slot, ids)
        ends.append(len(log))
    before = list(log.cuts or [])
    keep = max(0, len(feeds) - back)  # trim back to where feed number `keep` left the log
    log.trim(slot, ends[keep - 1] if keep else 0)
    for ids in feeds[keep:]:
        log.feed(slot, ids)
    assert log.cuts == before == slot.computed_cuts()


# ---- snapshots -------------------------------------------------------------------------
def float_snapshot(precision: str = "f32", n: int = 10, cuts=(3, 5, 7)) -> KVSnapshot:
    rng = np.random.default_rng(7)
    keys = rng.standard_normal((2, 1, 2, n, 4)).astype(np.float32)
    return KVSnapshot.from_float(range(n), keys, keys * 0.5, precision=precision, fingerprint="fp", cuts=cuts)


def raw_snapshot(n: int = 70, cuts=(32, 40, 64)) -> KVSnapshot:
    rng = np.random.default_rng(8)
    blocks = -(-n // 32)
    keys = rng.integers(0, 256, (2, blocks, 2, 32, 8 + 4), dtype=np.uint8)  # by token: scale, zero, codes
    values = rng.integers(0, 256, (2, blocks, 2, 32, 8 + 4), dtype=np.uint8)
    return KVSnapshot.from_blocks(range(n), keys, values, block_tokens=32, fingerprint="fp", cuts=cuts)


def assert_same(a: KVSnapshot, b: KVSnapshot) -> None:
    assert (a.tokens, a.cuts, a.precision, a.fingerprint, a.block_tokens) == (
        b.tokens, b.cuts, b.precision, b.fingerprint, b.block_tokens)
    for name in ("keys", "values", "key_scale", "key_zero", "value_scale", "value_zero"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None) and (x is None or (x.dtype == y.dtype and x.tobytes() == y.tobytes()))


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16", "u8"])
def test_join_of_two_spans_gives_the_snapshot_back_bit_for_bit_at_every_split(precision):
    snap = float_snapshot(precision)
    for a in range(snap.num_tokens + 1):
        assert_same(KVSnapshot.join([snap.span(0, a), snap.span(a, snap.num_tokens)]), snap)
    assert_same(KVSnapshot.join([snap.span(2, 5), snap.span(5, 9)]), snap.span(2, 9))


def test_raw_u8_blocks_span_and_join_at_block_bounds_only():
    snap = raw_snapshot()
    for a in (0, 32, 64):
        assert_same(KVSnapshot.join([snap.span(0, a), snap.span(a, 70)]), snap)
    assert snap.span(32, 64).keys.shape[1] == 1 and snap.span(32, 64).cuts == (0, 8)
    with pytest.raises(UserError, match="block bounds"):
        snap.span(0, 40)
    with pytest.raises(UserError, match="block bounds"):
        KVSnapshot.join([snap.span(64, 70), snap.span(64, 70)])


def test_a_span_says_whether_a_pass_began_at_its_first_token_and_join_gives_that_back():
    snap = float_snapshot(cuts=(3, 5, 7))
    assert snap.span(5, 9).cuts == (0, 2) and snap.span(4, 9).cuts == (1, 3) and snap.span(0, 3).cuts == ()
    assert KVSnapshot.join([snap.span(0, 5), snap.span(5, 10)]).cuts == (3, 5, 7)
    assert KVSnapshot.join([snap.span(0, 4), snap.span(4, 10)]).cuts == (3, 5, 7)
    assert snap.prefix(5).cuts == (3,)
    assert span_cuts(None, 1, 3) is None and join_cuts([((), 4), (None, 2)]) is None


def test_join_refuses_spans_of_another_model_precision_or_layout():
    snap = float_snapshot("f32")
    with pytest.raises(UserError, match="one snapshot kind"):
        KVSnapshot.join([snap.span(0, 5), float_snapshot("f16").span(5, 10)])
    three_heads = np.zeros((2, 1, 3, 3, 4), np.float32)
    other = KVSnapshot.from_float(range(3), three_heads, three_heads, precision="f32", fingerprint="fp")
    with pytest.raises(UserError, match="one layout"):
        KVSnapshot.join([snap, other])
    with pytest.raises(UserError, match="at least one"):
        KVSnapshot.join([])


@pytest.mark.parametrize("cuts", [(5, 3), (3, 3), (0, 10), (-1,), ("3",)])
def test_cuts_out_of_order_repeated_or_outside_the_tokens_are_refused(cuts):
    with pytest.raises(UserError, match="cuts"):
        float_snapshot(cuts=cuts)
    with pytest.raises(UserError):
        checked_cuts(cuts, 10)


def test_cuts_survive_a_file_and_a_file_without_them_reads_as_unknown(tmp_path):
    snap = raw_snapshot()
    snap.to_file(tmp_path / "raw.agkv")
    assert_same(KVSnapshot.from_file(tmp_path / "raw.agkv"), snap)
    unknown = float_snapshot(cuts=None)
    unknown.to_file(tmp_path / "old.agkv")
    assert KVSnapshot.from_file(tmp_path / "old.agkv").cuts is None


BEFORE_CUTS = Path(__file__).parent / "data" / "snapshots_before_cuts"
"""Files the code before cuts existed wrote (see the README there)."""


@pytest.mark.parametrize("name", ["f32.agkv", "u8.agkv", "raw.agkv"])
def test_a_file_the_code_before_cuts_wrote_still_verifies_and_reads_with_cuts_unknown(tmp_path, name):
    read = KVSnapshot.from_file(BEFORE_CUTS / name, expected_fingerprint="fp")
    assert read.cuts is None and read.tokens == tuple(range(read.num_tokens))
    read.to_file(tmp_path / name)  # written again: still without cuts, the same checksum
    assert KVSnapshot.from_file(tmp_path / name).checksum() == read.checksum()
    log, slot = KVLog(), PassSlot()
    if read.precision != "u8-paged":
        log.load(slot, read, exact=False)
        assert log.cuts is None


def test_a_file_whose_cuts_are_damaged_is_corrupt(tmp_path):
    snap = float_snapshot(cuts=(3,))
    path = tmp_path / "s.agkv"
    snap.to_file(path)
    data = bytearray(path.read_bytes())
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    begin, _ = header["cuts"]["data_offsets"]
    offset = 8 + header_len + begin
    data[offset : offset + 8] = struct.pack("<q", 99)  # a cut past the tokens
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt):
        KVSnapshot.from_file(path)


def test_a_hit_and_a_cold_start_of_the_same_log_give_the_same_block_keys():
    """The log's cuts go into block keys as they are: a log fed in one turn and one fed in two,
    the second starting at a registered boundary, differ only where a pass began."""
    space = KVNamespace(salt="", fingerprint="fp", layout="paged", precision="f32", numerics="f32", chunk_size=64)
    boundaries = PrefixBoundaries()
    prompt = list(range(1, 101))
    boundaries.register(prompt[:40])
    cold_slot, cold = PassSlot(), KVLog(boundaries=boundaries, chunk_size=64)
    cold.feed(cold_slot, prompt)
    warm_slot, warm = PassSlot(), KVLog(boundaries=boundaries, chunk_size=64)
    warm.feed(warm_slot, prompt[:40])
    warm.feed(warm_slot, prompt[40:])
    assert cold.cuts == warm.cuts == [40, 64]
    assert space.chain(cold.tokens, cuts=cold.cuts).keys == space.chain(warm.tokens, cuts=warm.cuts).keys


# ---- prefix caches ---------------------------------------------------------------------
def kv_of(n: int) -> tuple[np.ndarray, np.ndarray]:
    keys = np.arange(n, dtype=np.float32).reshape(1, 1, 1, n, 1)
    return keys, keys + 0.5


def test_the_radix_cache_gives_back_the_cuts_of_the_kv_it_holds_across_edge_splits():
    cache = PrefixCache(fingerprint="fp", budget_bytes=None)
    tokens = list(range(1, 21))
    cache.insert(tokens, *kv_of(20), cuts=[8, 12])
    cache.insert(tokens[:10] + [99] * 6, *kv_of(16), cuts=[8, 10])  # splits the edge at 10
    whole = cache.lookup([*tokens, 0])
    assert whole is not None and whole.cuts == (8, 12)
    branch = cache.lookup([*tokens[:10], *[99] * 6, 0])
    assert branch is not None and branch.cuts == (8, 10)
    assert cache.lookup(tokens[:11]).cuts == (8,)


def test_the_radix_cache_says_unknown_for_kv_computed_after_a_prefix_cut_otherwise():
    cache = PrefixCache(fingerprint="fp", budget_bytes=None)
    tokens = list(range(1, 21))
    cache.insert(tokens[:10], *kv_of(10), cuts=[4])
    cache.insert(tokens, *kv_of(20), cuts=[5, 10])  # its first 10 tokens' KV was cut at 5, not 4
    assert cache.lookup([*tokens[:10], 0]).cuts == (4,)
    assert cache.lookup([*tokens, 0]).cuts is None
    cache.insert(tokens[:10] + [7] * 5, *kv_of(15), cuts=[4, 10])  # the same cuts as the path: known
    assert cache.lookup([*tokens[:10], *[7] * 5, 0]).cuts == (4, 10)
    cache.insert([3, 3, 3], *kv_of(3))  # no cuts given: unknown
    assert cache.lookup([3, 3, 3, 0]).cuts is None


class CutSession:
    """Just enough of a session for ``capture``: its tokens and cuts."""

    def __init__(self, tokens, cuts) -> None:
        self.tokens, self.cuts, self.shifted, self.kv_exact = tuple(tokens), cuts, False, True


async def test_the_paged_prefix_cache_hands_out_the_cuts_of_the_blocks_it_shares():
    pool = BlockPool(8)
    boundaries = PrefixBoundaries()
    prefix = tuple(range(1000, 1040))
    boundaries.register(prefix)
    cache = PagedPrefixCache(pool, boundaries=boundaries, max_blocks=None, block_bytes=1)
    model = FakePagedModel(pool)
    slot, log = PagedSlot(model, pool), KVLog(boundaries=boundaries, chunk_size=32)
    log.feed(slot, [*prefix, 1, 2])
    assert log.cuts == [32, 40]
    assert await cache.capture(CutSession(log.tokens, log.cuts), slot) == len(prefix)
    hit = cache.lookup([*prefix, 5])
    assert hit is not None and hit.cuts == (32,)
    other, other_log = PagedSlot(model, pool), KVLog(boundaries=boundaries, chunk_size=32)
    other_log.load(other, hit, exact=True)
    other_log.feed(other, [5])
    assert other_log.cuts == [32, 40]
    cache.clear()
    for table in (slot, other):
        table.reset()
    assert pool.free_blocks == pool.num_blocks
