"""Canonical chunking: prefill cuts are a function of the token log (registered prefix
boundaries and absolute multiples of the chunk size), never of the path that reached it."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from agentkv.kv.chunking import PrefixBoundaries, chunk_spans


def test_spans_are_cut_at_boundaries_and_absolute_multiples_of_the_chunk_size():
    assert chunk_spans(5, 20, cuts=[12], chunk_size=8) == [(5, 8), (8, 12), (12, 16), (16, 20)]
    assert chunk_spans(0, 10) == [(0, 10)]
    assert chunk_spans(3, 4, cuts=[3, 4, 9]) == [(3, 4)]  # cuts on or outside the edges are ignored


@given(total=st.integers(2, 200), start=st.integers(0, 199), chunk=st.one_of(st.none(), st.integers(1, 64)),
       cuts=st.lists(st.integers(0, 200), max_size=5))
def test_resuming_a_prefill_anywhere_reproduces_the_same_cuts_after_that_point(total, start, chunk, cuts):
    start = min(start, total - 1)
    whole = chunk_spans(0, total, cuts=cuts, chunk_size=chunk)
    resumed = chunk_spans(start, total, cuts=cuts, chunk_size=chunk)
    assert resumed[0][0] == start and resumed[-1][1] == total
    assert all(a < b for a, b in resumed) and all(b == c for (_, b), (c, _) in zip(resumed, resumed[1:]))
    # every cut of the whole prefill past ``start`` is a cut of the resumed one
    assert {b for _, b in whole if b > start} <= {b for _, b in resumed}


def test_registered_prefixes_cut_only_the_logs_they_prefix():
    boundaries = PrefixBoundaries()
    boundaries.register([1, 2, 3])
    boundaries.register([1, 2, 3, 4, 5], salt="tenant-b")
    boundaries.register([9, 9])
    log = [1, 2, 3, 4, 5, 6, 7]
    assert boundaries.cuts_within(log, start=0, stop=7) == [3, 5]  # any salt: cuts change no values
    assert boundaries.cuts_within(log, start=3, stop=7) == [5]  # a boundary at the start is no cut
    assert boundaries.prefixes_of(log) == [(1, 2, 3)]
    assert boundaries.prefixes_of(log, salt="tenant-b") == [(1, 2, 3, 4, 5)]


def test_the_registry_forgets_the_least_recently_registered_beyond_its_bound():
    boundaries = PrefixBoundaries(max_registered=2)
    for mark in ([1], [1, 2], [1, 2, 3]):
        boundaries.register(mark)
    boundaries.register([1, 2])  # refreshed: now the most recent
    boundaries.register([7])
    assert boundaries.prefixes_of([1, 2, 3, 4]) == [(1, 2)]
