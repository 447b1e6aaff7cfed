"""Snapshots carry the cuts (where each pass that computed their KV began) through spans, joins and
files, bit for bit: every split of a float snapshot joins back to it, raw u8 blocks only at block
bounds, bad cuts and damaged files are refused, and files written before cuts existed still verify
and read with the cuts unknown."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from test_kv_cuts import PassSlot

from agentkv.errors import SnapshotCorrupt, UserError
from agentkv.kv.log import KVLog
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kv.snapshot_cuts import checked_cuts, join_cuts, span_cuts


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
