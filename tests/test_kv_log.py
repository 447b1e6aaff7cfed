"""KVLog keeps the slot's KV and the token log in step through every operation, and leaves both
empty (never half-changed) when a KV write fails. A fake slot stands in for the model."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.log import KVLog, KVLogCorrupt
from agentkv.kv.rope import RopeConvention
from agentkv.kv.snapshot import KVSnapshot

VOCAB = 16


class FakeSlot:
    """A slot whose "KV" is the fed ids themselves ([layers=1, batch, heads=1, T, dim=1])."""

    def __init__(self) -> None:
        self.rows: list[list[int]] = [[]]
        self.feeds: list[tuple[int, int]] = []  # (past_len, length) of each feed
        self.fail_writes = False

    def feed(self, input_ids, past_len, beam_idx=None):
        if beam_idx is not None:
            self.rows = [list(self.rows[int(r)]) for r in beam_idx]
        assert all(len(row) == past_len for row in self.rows), (self.rows, past_len)
        for row, ids in zip(self.rows, np.asarray(input_ids)):
            row.extend(int(t) for t in ids)
        self.feeds.append((past_len, np.asarray(input_ids).shape[1]))
        return np.stack([np.eye(VOCAB, dtype=np.float32)[row[-1] % VOCAB] for row in self.rows])

    def length(self):
        return len(self.rows[0])

    def reset(self):
        self.rows = [[]]

    def trim(self, n):
        if self.fail_writes:  # as a stateful trim that fails after rewriting some layers
            self.rows = [row[:n] for row in self.rows[:1]] + self.rows[1:]
            raise RuntimeError("device lost")
        self.rows = [row[:n] for row in self.rows]

    def read(self):
        kv = np.array(self.rows, dtype=np.float32)[None, :, None, :, None]
        return kv, kv.copy()

    def write(self, keys, values):
        if self.fail_writes:
            raise RuntimeError("device lost")
        self.rows = [[int(v) for v in row] for row in keys[0, :, 0, :, 0]]

    def select_row(self, row, n):
        self.rows = [self.rows[row][:n]]


def test_feed_cuts_at_registered_boundaries_and_absolute_chunk_multiples():
    boundaries = PrefixBoundaries()
    boundaries.register([1, 2, 3])
    slot, log = FakeSlot(), KVLog(boundaries=boundaries, chunk_size=4)
    log.feed(slot, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert slot.feeds == [(0, 3), (3, 1), (4, 4), (8, 1)]
    assert log.tokens == slot.rows[0] and int(log.last_logits.argmax()) == 9


def test_a_failed_write_or_trim_leaves_the_slot_and_the_log_empty_never_half_changed():
    slot, log = FakeSlot(), KVLog()
    log.feed(slot, [1, 2, 3])
    slot.fail_writes = True
    zeros = np.zeros((1, 1, 1, 2, 1), np.float32)
    snapshot = KVSnapshot.from_float([7, 8], zeros, zeros, fingerprint="x")
    with pytest.raises(RuntimeError):
        log.load(slot, snapshot, exact=True)
    assert log.tokens == [] and slot.length() == 0
    log.feed(slot, [1, 2, 3])
    with pytest.raises(RuntimeError):
        log.drop(slot, 0, 1, RopeConvention("none", (), None, None, 0.0))
    assert log.tokens == [] and slot.length() == 0
    log.feed(slot, [1, 2, 3])
    with pytest.raises(RuntimeError):
        log.trim(slot, 1)
    assert log.tokens == [] and slot.length() == 0


def test_check_integrity_catches_a_slot_out_of_step_with_the_log():
    slot, log = FakeSlot(), KVLog()
    log.feed(slot, [1, 2])
    log.check_integrity(slot)
    slot.rows[0].append(9)
    with pytest.raises(KVLogCorrupt):
        log.check_integrity(slot)


def test_beam_collapse_keeps_one_row_holding_the_winner():
    slot, log = FakeSlot(), KVLog()
    prompt_logits = log.feed(slot, [1, 2])
    slot.feed(np.array([[3], [4]]), 2, np.array([0, 0]))  # two beams
    slot.feed(np.array([[5], [6]]), 3, np.array([1, 0]))  # reordered
    log.collapse_feeding(slot, 0, [4, 5], [7])  # row 0 holds the prompt, then 4 5
    assert log.tokens == [1, 2, 4, 5, 7] == slot.rows[0] and len(slot.rows) == 1
    log.collapse(slot, 0, [1, 2], prompt_logits)
    assert log.tokens == [1, 2] == slot.rows[0] and log.last_logits is prompt_logits


operation = st.one_of(
    st.tuples(st.just("feed"), st.lists(st.integers(1, 15), min_size=1, max_size=6)),
    st.tuples(st.just("trim"), st.integers(0, 12)),
    st.tuples(st.just("drop"), st.integers(0, 12), st.integers(0, 4)),
    st.tuples(st.just("reload"),),
)


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(operation, max_size=12))
def test_the_slot_always_holds_exactly_the_kv_of_the_log(ops):
    slot, log = FakeSlot(), KVLog()
    none = RopeConvention("none", (), None, None, 0.0)
    for op in ops:
        if op[0] == "feed":
            log.feed(slot, op[1])
        elif op[0] == "trim":
            log.trim(slot, op[1])
        elif op[0] == "drop" and log.tokens:
            start = min(op[1], len(log))
            log.drop(slot, start, min(len(log), start + op[2]), none)
        elif op[0] == "reload":
            keys, values = log.read(slot)
            snapshot = KVSnapshot.from_float(log.tokens, keys, values, fingerprint="x", shifted=log.shifted)
            log.load(slot, snapshot, exact=True)
        log.check_integrity(slot)
        assert slot.rows[0] == log.tokens


def test_the_module_docstrings_name_only_classes_that_exist():
    import ast
    import importlib
    import pkgutil
    import re

    import agentkv
    import agentkv.kv.log as kv_log

    tree = ast.parse(open(kv_log.__file__).read())
    texts = [ast.get_docstring(node) or "" for node in ast.walk(tree)
             if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))]
    named = {m for text in texts for m in re.findall(r"``([A-Z][A-Za-z]+)``", text)}
    modules = [importlib.import_module(i.name) for i in pkgutil.walk_packages(agentkv.__path__, "agentkv.")
               if not i.name.startswith("agentkv.cli")]
    missing = sorted(n for n in named if not any(hasattr(m, n) for m in modules))
    assert named and missing == []
