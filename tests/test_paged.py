"""The PagedAttention form of the default model (issue 15, first step): a paged model with
caller-owned KV blocks, a block pool, and a paged slot that KVLog runs on.

Exactness as measured here (f32 KV, exact numerics): any multi-token chunking equals a one-pass
prefill bit for bit; a prefix shared by block table (no copy) equals a cold prefill bit for bit;
paged vs stateful one-pass ~4e-5; two sequences in one step vs each alone ~5e-5.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.paged.block_pool import BlockPool, KVPoolExhausted
from agentkv.errors import UserError


# ---- the block pool (no model) ----------------------------------------------------------------
def test_allocation_beyond_the_free_blocks_fails_whole_and_takes_nothing():
    pool = BlockPool(4)
    held = pool.allocate(3)
    with pytest.raises(KVPoolExhausted, match="1 of 4 free"):
        pool.allocate(2)
    assert pool.free_blocks == 1
    pool.release(held)
    assert pool.free_blocks == 4


def test_misuse_of_blocks_is_refused():
    pool = BlockPool(2)
    with pytest.raises(UserError):
        pool.share([0])
    block = pool.allocate(1)
    pool.release(block)
    with pytest.raises(UserError):
        pool.release(block)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["allocate", "share", "release"]), st.integers(0, 5)), max_size=40))
def test_no_block_is_ever_leaked_or_both_free_and_held(ops):
    pool = BlockPool(8)
    tables: list[list[int]] = []
    for kind, n in ops:
        if kind == "allocate":
            try:
                tables.append(pool.allocate(n))
            except KVPoolExhausted:
                pass
        elif kind == "share" and tables:
            tables.append(list(tables[n % len(tables)][: max(1, n)]))
            pool.share(tables[-1])
        elif kind == "release" and tables:
            pool.release(tables.pop(n % len(tables)))
        pool.check_integrity()
    for table in tables:
        pool.release(table)
    assert pool.free_blocks == 8


@given(st.lists(st.integers(0, 1000), max_size=300))
def test_a_padded_block_table_keeps_its_blocks_first_in_a_power_of_two_less_than_twice_as_long(blocks):
    from agentkv.engine.paged.request_inputs import TABLE_BUCKET, padded_table

    padded = padded_table(blocks)
    assert padded[:len(blocks)] == blocks and set(padded[len(blocks):]) <= {0}
    size = len(padded)
    assert size & (size - 1) == 0 and size >= TABLE_BUCKET and (size < 2 * len(blocks) or size == TABLE_BUCKET)
