"""Content digests (kv/digest.py): one canonical encoding of token ids, which block keys and the
snapshot rows' token digest share, refusing what is not a non-negative int."""

from __future__ import annotations

import re

import numpy as np
import pytest

from agentkv.errors import UserError
from agentkv.kv.digest import int64_bytes, tokens_digest


def test_token_ids_encode_as_int64_little_endian_whatever_their_container():
    expected = b"".join(t.to_bytes(8, "little") for t in (1, 2, 300))
    assert int64_bytes([1, 2, 300]) == expected
    assert int64_bytes((1, 2, 300)) == expected
    assert int64_bytes(range(1, 3)) + int64_bytes([300]) == expected
    for dtype in (np.int32, np.uint16, np.uint64, ">i8"):
        assert int64_bytes(np.asarray([1, 2, 300], dtype=dtype)) == expected
    assert int64_bytes([]) == b"" and int64_bytes(()) == b""


def test_the_token_log_digest_stored_in_snapshot_rows_is_unchanged():
    # memory/queries.py stores tokens_digest in the snapshots table: existing rows must still match
    assert tokens_digest([1, 2, 3]) == "abccad42d03c940bc2b249bf5a4e1e3d"
    assert tokens_digest([]) == "cae66941d9efbd404e4d88758ea67670"


@pytest.mark.parametrize(("values", "message"), [
    ([3, -1], "positions must be non-negative, got -1 at index 1; pass positions"),
    ([0.5], "positions must be a flat sequence of non-negative ints, got floats; pass positions"),
    ([False], "got bools"),
    ([2**63], "positions must fit int64, got 9223372036854775808"),
    ([2**64], "positions must be a flat sequence of non-negative ints"),
    (np.asarray([2**63], dtype=np.uint64), "positions must fit int64"),
])
def test_what_is_not_a_non_negative_int64_is_refused_naming_it_and_what_to_do(values, message):
    with pytest.raises(UserError, match=re.escape(message)):
        int64_bytes(values, what="positions", fix="pass positions")
    with pytest.raises(UserError, match="pass the tokenizer's ids"):
        tokens_digest(values)
