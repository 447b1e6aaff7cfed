"""Block files: a keyed block's bytes give back its span bit for bit, and anything else under its name is refused."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import SnapshotCorrupt, UserError
from agentkv.kv.block_codec import BlockCorrupt, BlockForeign, decode_block, encode_block, join_blocks
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot

SPACE = KVNamespace(salt="", fingerprint="model-a:kv=f32", layout="paged", precision="f32",
                    numerics="exact", chunk_size=64)


def snapshot(n: int, *, precision: str = "auto", cuts: tuple[int, ...] = (), seed: int = 0,
             bf16: bool = False) -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, 1, 2, n, 4)).astype(np.float32)
    values = rng.standard_normal((2, 1, 2, n, 4)).astype(np.float32)
    if bf16:  # values a bfloat16 holds exactly: "auto" stores them as bf16
        keys = (keys.view(np.uint32) & 0xFFFF0000).view(np.float32)
        values = (values.view(np.uint32) & 0xFFFF0000).view(np.float32)
    return KVSnapshot.from_float(tuple(range(100, 100 + n)), keys, values, precision=precision,  # type: ignore[arg-type]
                                 fingerprint="model-a:kv=f32", cuts=cuts)


def blocks_of(snap: KVSnapshot, space: KVNamespace = SPACE) -> list[tuple[str, str, int, bytes]]:
    chain = space.chain(snap.tokens, cuts=snap.cuts or ())
    out, parent = [], space.id
    for i, key in enumerate(chain.keys):
        start = i * space.block_size
        out.append((key, parent, start, encode_block(snap.span(start, start + space.block_size), key=key,
                                                     parent=parent, start=start, cuts=snap.cuts)))
        parent = key
    return out


def assert_same(a: KVSnapshot, b: KVSnapshot) -> None:
    assert a.tokens == b.tokens and a.cuts == b.cuts and a.precision == b.precision
    for name in ("keys", "values", "key_scale", "key_zero", "value_scale", "value_zero"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None)
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("precision", ["f32", "f16", "bf16", "u8"])
def test_blocks_and_a_tail_join_back_into_the_snapshot_bit_for_bit(precision: str) -> None:
    snap = snapshot(80, precision=precision, cuts=(20, 33, 40, 41, 64, 70))
    parts = [decode_block(data, key=key, parent=parent, start=start, namespace=SPACE)
             for key, parent, start, data in blocks_of(snap)]
    assert_same(join_blocks([*parts, snap.span(64, 80)]), snap)


def test_a_block_keeps_a_cut_at_its_first_token() -> None:
    snap = snapshot(64, cuts=(32, 50))
    (_, _, _, _), (key, parent, start, data) = blocks_of(snap)
    assert decode_block(data, key=key, parent=parent, start=start, namespace=SPACE).cuts == (0, 18)


def test_blocks_in_different_lossless_precisions_join_to_the_same_values() -> None:
    exact_bf16 = snapshot(64, bf16=True)
    as_f32 = KVSnapshot.from_float(exact_bf16.tokens, *exact_bf16.to_float(), precision="f32",
                                   fingerprint=exact_bf16.fingerprint, cuts=())
    assert exact_bf16.precision == "bf16"
    joined = join_blocks([exact_bf16.span(0, 32), as_f32.span(32, 64)])
    assert all(np.array_equal(x, y) for x, y in zip(joined.to_float(), exact_bf16.to_float()))


def test_a_truncated_block_is_corrupt() -> None:
    key, parent, start, data = blocks_of(snapshot(32))[0]
    for cut in (0, 7, 100, len(data) - 1):
        with pytest.raises(BlockCorrupt):
            decode_block(data[:cut], key=key, parent=parent, start=start, namespace=SPACE)


def test_a_flipped_byte_fails_the_checksum() -> None:
    key, parent, start, data = blocks_of(snapshot(32))[0]
    damaged = bytearray(data)
    damaged[-5] ^= 0xFF
    with pytest.raises(BlockCorrupt, match="checksum"):
        decode_block(bytes(damaged), key=key, parent=parent, start=start, namespace=SPACE)


def test_another_logs_block_under_a_keys_name_is_foreign() -> None:
    (key_a, parent, start, _), = blocks_of(snapshot(32, seed=1))
    other = snapshot(32, seed=2)
    other = KVSnapshot.from_float(tuple(range(7, 39)), *other.to_float(), precision="f32",
                                  fingerprint=other.fingerprint, cuts=())
    (_, _, _, data_b), = blocks_of(other)
    with pytest.raises(BlockForeign):
        decode_block(data_b, key=key_a, parent=parent, start=start, namespace=SPACE)


def test_another_tenants_block_is_foreign_even_with_the_same_tokens() -> None:
    snap = snapshot(32)
    (key, parent, start, data), = blocks_of(snap, dataclasses.replace(SPACE, salt="tenant-b"))
    tenant_a_key = SPACE.chain(snap.tokens).keys[0]
    with pytest.raises(BlockForeign):
        decode_block(data, key=tenant_a_key, parent=SPACE.id, start=start, namespace=SPACE)


def test_a_foreign_block_is_a_snapshot_corrupt_for_callers_that_skip_those() -> None:
    assert issubclass(BlockForeign, SnapshotCorrupt)


def test_a_shifted_kv_is_not_stored_as_blocks() -> None:
    snap = snapshot(32)
    shifted = KVSnapshot.from_float(snap.tokens, *snap.to_float(), precision="f32", fingerprint=snap.fingerprint,
                                    shifted=True, cuts=())
    with pytest.raises(UserError, match="shifted"):
        encode_block(shifted, key="0" * 32, parent=SPACE.id, start=0, cuts=())


@settings(max_examples=25, deadline=None)
@given(n=st.integers(32, 130), data=st.data())
def test_any_cuts_and_length_round_trip_through_blocks(n: int, data: st.DataObject) -> None:
    cuts = tuple(sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=12))))
    snap = snapshot(n, precision="f32", cuts=cuts)
    parts = [decode_block(b, key=k, parent=p, start=s, namespace=SPACE) for k, p, s, b in blocks_of(snap)]
    whole = (n // 32) * 32
    tail = [snap.span(whole, n)] if whole < n else []
    assert_same(join_blocks([*parts, *tail]), snap)
