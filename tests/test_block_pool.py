"""BlockPool's bookkeeping: a broken pool is a named error, also under ``python -O``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.errors import KVPoolCorrupt


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
