"""BlockPool's bookkeeping: reservations go to their holder; a broken pool is a named error, also
under ``python -O``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.errors import KVPoolCorrupt, KVPoolExhausted


def test_a_block_both_free_and_held_is_a_named_error_naming_the_block():
    pool = BlockPool(4)
    pool.allocate(2)
    pool._refs[3] = 1  # held, yet still on the free list
    with pytest.raises(KVPoolCorrupt, match="block 3") as caught:
        pool.check_integrity()
    assert caught.value.block == 3


def test_a_block_on_the_free_list_twice_is_a_named_error():
    pool = BlockPool(4)
    pool._free.append(0)
    with pytest.raises(KVPoolCorrupt, match="free list twice"):
        pool.check_integrity()


def test_the_integrity_check_still_raises_when_python_drops_asserts():
    code = ("from agentkv.engine.paged.block_pool import BlockPool\n"
            "pool = BlockPool(2); pool._refs[1] = 1\n"
            "try:\n    pool.check_integrity()\nexcept Exception as e:\n    print(type(e).__name__)\n")
    out = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "KVPoolCorrupt"


def test_reserved_blocks_go_to_their_holder_and_nobody_else():
    pool = BlockPool(4)
    first, second = object(), object()
    assert pool.reserve(first, 3) and pool.unreserved_blocks == 1 and pool.free_blocks == 4
    assert not pool.reserve(second, 2) and pool.reserved(second) == 0  # refused: nothing changed
    with pytest.raises(KVPoolExhausted, match="1 of 4 free"):
        pool.allocate(2, holder=second)  # only the unreserved block is its to take
    assert len(pool.allocate(2, holder=first)) == 2 and pool.reserved(first) == 1
    assert len(pool.allocate(2, holder=first)) == 2 and pool.reserved(first) == 0  # its last one, then the free one
    pool.check_integrity()
    pool.release(list(range(4)))
    assert pool.reserve(second, 2) and pool.reserve(second, 1) and pool.unreserved_blocks == 3  # replaced, not added
    pool.unreserve(second)
    assert pool.unreserved_blocks == pool.free_blocks == 4
    pool.check_integrity()


def test_more_reserved_than_free_is_a_named_error():
    pool = BlockPool(2)
    pool._reserved_total = 3
    with pytest.raises(KVPoolCorrupt, match="reserved"):
        pool.check_integrity()
