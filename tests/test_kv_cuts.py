"""Every KV knows where the passes that computed it began: KVLog keeps ``cuts`` in step with its
tokens through feeds, runs, trims, drops, loads and beam collapses, and block keys take them as they
are. A fake slot stands in for the model; its "KV" records, per position, whether a pass began there,
so the log's cuts are checked against what the slot really computed. Snapshots' cuts (spans, joins,
files) are in ``test_snapshot_cuts.py``, the prefix caches' in ``test_prefix_cuts.py``."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog
from agentkv.kv.rope import RopeConvention
from agentkv.kv.snapshot import KVSnapshot

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
