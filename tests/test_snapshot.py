"""Tests for agentkv.kv.snapshot and snapshot_file: precisions, prefixes, checksums, safetensors and older files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from _legacy_snapshot import write_legacy
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from safetensors import safe_open
from safetensors.numpy import save_file

from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError
from agentkv.kv import snapshot_file
from agentkv.kv.digest import tokens_digest
from agentkv.kv.snapshot import (
    KVSnapshot,
    dequantize_u8,
    quantize_u8,
)
from agentkv.kv.u8_blocks import BlockLayout

FP = "model-abc|kv:u8|layers:30"
DEFAULT_SHAPE = (30, 1, 3, 64)  # layers, batch, heads, head_dim of the default model


def random_kv(num_tokens: int, *, seed: int = 0, layers: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    shape = (layers, 1, 3, num_tokens, 64)
    return (rng.standard_normal(shape, dtype=np.float32),
            rng.standard_normal(shape, dtype=np.float32))


def make(precision: str, num_tokens: int = 12, **kw: object) -> KVSnapshot:
    keys, values = random_kv(num_tokens)
    return KVSnapshot.from_float(range(100, 100 + num_tokens), keys, values,
                                 precision=precision, fingerprint=FP, **kw)  # type: ignore[arg-type]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize("precision", ["f32", "f16", "u8"])
def test_file_round_trip_keeps_tokens_metadata_and_values(tmp_path: Path, precision: str) -> None:
    keys, values = random_kv(9)
    snap = KVSnapshot.from_float(list(range(9)), keys, values, precision=precision,  # type: ignore[arg-type]
                                 fingerprint=FP, shifted=True)
    path = tmp_path / "s.agkv"
    snap.to_file(path)
    loaded = KVSnapshot.from_file(path, expected_fingerprint=FP)

    assert loaded.tokens == tuple(range(9))
    assert (loaded.precision, loaded.fingerprint, loaded.shifted) == (precision, FP, True)
    assert loaded.checksum() == snap.checksum()
    k_back, v_back = loaded.to_float()
    assert k_back.dtype == np.float32 and k_back.shape == keys.shape
    np.testing.assert_array_equal(k_back, snap.to_float()[0])
    np.testing.assert_array_equal(v_back, snap.to_float()[1])
    tolerance = {"f32": 0.0, "f16": 4e-3, "u8": 0.02}[precision]
    assert np.abs(k_back - keys).max() <= tolerance
    assert np.abs(v_back - values).max() <= tolerance


def test_u8_error_and_bytes_per_token_for_the_default_model_shape() -> None:
    rng = np.random.default_rng(1)
    keys = rng.standard_normal((*DEFAULT_SHAPE[:3], 256, DEFAULT_SHAPE[3]), dtype=np.float32)
    values = rng.standard_normal(keys.shape, dtype=np.float32)
    snaps = {p: KVSnapshot.from_float(range(256), keys, values, precision=p, fingerprint=FP)
             for p in ("f32", "f16", "u8")}
    errors = {p: float(np.abs(s.to_float()[0] - keys).max()) for p, s in snaps.items()}
    per_token = {p: s.bytes_per_token for p, s in snaps.items()}
    print(f"\nmax abs error vs f32 (standard normal): {errors}")
    print(f"bytes/token (30 layers x K,V x 3 heads x 64): {per_token}")

    assert per_token == {"f32": 46_080, "f16": 23_040, "u8": 12_960}
    assert all(s.nbytes == s.bytes_per_token * 256 for s in snaps.values())
    assert errors["f32"] == 0.0
    assert errors["f16"] < 4e-3
    # Range of 64 normal samples is ~5, so the step is ~0.02 and the error at most half of it.
    assert 0.005 < errors["u8"] < 0.02


@settings(max_examples=60, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=3, max_side=9),
                  elements=st.floats(-1e4, 1e4, width=32)))
def test_u8_quantisation_error_is_at_most_half_a_step(x: np.ndarray) -> None:
    q, scale, zero = quantize_u8(x)
    error = np.abs(dequantize_u8(q, scale, zero) - x)
    # half a step, plus float32 rounding of q * scale + zero (relative to the magnitudes involved)
    rounding = 4 * np.finfo(np.float32).eps * (np.abs(x) + np.abs(zero)[..., None] + 255 * scale[..., None] + 1)
    bound = scale[..., None] / 2 + rounding
    assert np.all(error <= bound)


def test_u8_constant_vectors_come_back_exactly() -> None:
    keys = np.full((2, 1, 3, 4, 64), 0.75, dtype=np.float32)
    snap = KVSnapshot.from_float(range(4), keys, -keys, precision="u8", fingerprint=FP)
    k_back, v_back = snap.to_float()
    np.testing.assert_array_equal(k_back, keys)
    np.testing.assert_array_equal(v_back, -keys)


@pytest.mark.parametrize("precision", ["f32", "f16", "u8"])
def test_prefix_equals_the_first_n_tokens(tmp_path: Path, precision: str) -> None:
    snap = make(precision, 12)
    head = snap.prefix(5)
    assert head.tokens == snap.tokens[:5] and head.num_tokens == 5
    full_k, full_v = snap.to_float()
    head_k, head_v = head.to_float()
    np.testing.assert_array_equal(head_k, full_k[:, :, :, :5])
    np.testing.assert_array_equal(head_v, full_v[:, :, :, :5])
    head.to_file(tmp_path / "head.agkv")  # a strided view still writes and reads back
    assert KVSnapshot.from_file(tmp_path / "head.agkv").checksum() == head.checksum()
    assert snap.prefix(0).num_tokens == 0 and snap.prefix(12).checksum() == snap.checksum()


def test_prefix_out_of_range_is_a_user_error() -> None:
    with pytest.raises(UserError, match="0..12"):
        make("f16", 12).prefix(13)


def test_from_float_copies_and_arrays_are_read_only() -> None:
    keys, values = random_kv(3)
    snap = KVSnapshot.from_float(range(3), keys, values, precision="f32", fingerprint=FP)
    keys[:] = 0.0
    assert np.abs(snap.keys).max() > 0
    with pytest.raises(ValueError):
        snap.keys[0, 0, 0, 0, 0] = 1.0


def test_token_count_must_match_the_kv_length() -> None:
    keys, values = random_kv(3)
    with pytest.raises(UserError, match="3 tokens but the log has 2"):
        KVSnapshot.from_float([1, 2], keys, values, precision="f32", fingerprint=FP)


def test_checksum_changes_with_data_and_metadata() -> None:
    base = make("u8")
    assert base.checksum() == make("u8").checksum()
    assert base.checksum() != make("u8", shifted=True).checksum()
    assert base.checksum() != make("f16").checksum()
    flipped = base.keys.copy()
    flipped[0, 0, 0, 0, 0] ^= 1
    other = KVSnapshot(tokens=base.tokens, keys=flipped, values=base.values, precision="u8",
                       fingerprint=FP, key_scale=base.key_scale, key_zero=base.key_zero,
                       value_scale=base.value_scale, value_zero=base.value_zero)
    assert other.checksum() != base.checksum()


@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_a_flipped_byte_in_the_file_is_corrupt(tmp_path: Path, where: str) -> None:
    path = tmp_path / "s.agkv"
    make("u8").to_file(path)
    data = bytearray(path.read_bytes())
    offset = {"header": 40, "payload": len(data) // 2, "last": len(data) - 1}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="delete it"):
        KVSnapshot.from_file(path)


@pytest.mark.parametrize("keep", [0, 10, 100, -1])
def test_a_truncated_file_is_corrupt(tmp_path: Path, keep: int) -> None:
    path = tmp_path / "s.agkv"
    make("f16").to_file(path)
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(SnapshotCorrupt, match=str(path)):
        KVSnapshot.from_file(path)


def test_a_missing_file_or_foreign_file_is_corrupt(tmp_path: Path) -> None:
    with pytest.raises(SnapshotCorrupt, match="cannot be read"):
        KVSnapshot.from_file(tmp_path / "absent.agkv")
    (tmp_path / "notes.txt").write_bytes(b"hello, this is not a snapshot at all")
    with pytest.raises(SnapshotCorrupt, match="bad magic"):
        KVSnapshot.from_file(tmp_path / "notes.txt")


def test_another_fingerprint_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "s.agkv"
    make("f32").to_file(path)
    with pytest.raises(SnapshotIncompatible, match="other-model"):
        KVSnapshot.from_file(path, expected_fingerprint="other-model")
    assert KVSnapshot.from_file(path).fingerprint == FP


def test_a_newer_file_format_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "s.agkv"
    make("f32").to_file(path)
    payload = snapshot_file.read_payload(path)
    header = {**payload.header, "format_version": snapshot_file.FORMAT_VERSION + 1}
    save_file(payload.arrays, path, metadata={snapshot_file.HEADER_KEY: json.dumps(header)})
    with pytest.raises(SnapshotIncompatible, match="upgrade agentkv"):
        KVSnapshot.from_file(path)


def test_an_older_raw_file_of_a_newer_version_is_incompatible(tmp_path: Path) -> None:
    path = tmp_path / "s.agkv"
    write_legacy(make("f32"), path)
    data = bytearray(path.read_bytes())
    data[8:12] = (snapshot_file.FORMAT_VERSION + 1).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotIncompatible, match="upgrade agentkv"):
        KVSnapshot.from_file(path)


def test_write_leaves_no_temp_file_and_replaces_the_old_one(tmp_path: Path) -> None:
    path = tmp_path / "s.agkv"
    make("f32", 4).to_file(path)
    make("u8", 7).to_file(path)
    assert KVSnapshot.from_file(path).num_tokens == 7
    assert leftovers(tmp_path) == [] and [p.name for p in tmp_path.iterdir()] == ["s.agkv"]


def test_a_failed_write_keeps_the_existing_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "s.agkv"
    make("f32", 4).to_file(path)
    before = path.read_bytes()

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        make("u8", 9).to_file(path)
    assert path.read_bytes() == before
    assert leftovers(tmp_path) == []


def test_tokens_digest_depends_on_order_and_values() -> None:
    assert tokens_digest([1, 2, 3]) == tokens_digest((1, 2, 3))
    assert tokens_digest([1, 2, 3]) != tokens_digest([3, 2, 1])
    assert len(tokens_digest([])) == 32


# ---- lossless storage ("auto") -------------------------------------------------------------
def as_bf16(x: np.ndarray) -> np.ndarray:
    return (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)


@pytest.mark.parametrize(
    ("cast", "stored"),
    [(as_bf16, "bf16"), (lambda x: x.astype(np.float16).astype(np.float32), "f16"), (lambda x: x, "f32")],
)
def test_auto_stores_the_smallest_form_that_gives_back_every_value_bit_for_bit(tmp_path: Path, cast, stored) -> None:
    keys, values = (cast(a) for a in random_kv(7))
    snap = KVSnapshot.from_float(range(7), keys, values, fingerprint=FP)
    assert (snap.precision, snap.lossless) == (stored, True)
    snap.to_file(tmp_path / "s")
    loaded = KVSnapshot.from_file(tmp_path / "s")
    assert loaded.lossless and loaded.precision == stored
    assert np.array_equal(loaded.to_float()[0], keys) and np.array_equal(loaded.to_float()[1], values)


@pytest.mark.parametrize("precision", ["bf16", "f16", "u8"])
def test_an_explicit_lossy_precision_says_it_rounded(precision: str) -> None:
    snap = make(precision)
    assert snap.precision == precision and not snap.lossless


def test_kv_that_was_already_inexact_stays_marked_through_files_and_prefixes(tmp_path: Path) -> None:
    keys, values = random_kv(5)
    snap = KVSnapshot.from_float(range(5), keys, values, fingerprint=FP, lossless=False)
    assert snap.precision == "f32" and not snap.lossless and not snap.prefix(3).lossless
    snap.to_file(tmp_path / "s")
    assert not KVSnapshot.from_file(tmp_path / "s").lossless


def test_files_written_before_the_lossless_flag_still_verify_and_read_as_inexact(tmp_path: Path) -> None:
    snap = make("f16")  # lossy: its header carries no "lossless" key, as files written before it did
    snap.to_file(tmp_path / "old")
    loaded = KVSnapshot.from_file(tmp_path / "old", expected_fingerprint=FP)
    assert loaded.checksum() == snap.checksum() and loaded.lossless is False


# ---- the file format: safetensors, and files written before it -----------------------------
def test_a_snapshot_file_is_safetensors_with_the_header_in_its_metadata(tmp_path: Path) -> None:
    snap = make("u8")
    snap.to_file(tmp_path / "s.agkv")
    with safe_open(tmp_path / "s.agkv", framework="np") as f:
        header = json.loads(f.metadata()[snapshot_file.HEADER_KEY])
        assert sorted(f.keys()) == sorted(["tokens", "keys", "values", "key_scale", "key_zero",
                                           "value_scale", "value_zero"])
        np.testing.assert_array_equal(f.get_tensor("keys"), snap.keys)
    assert header["format_version"] == snapshot_file.FORMAT_VERSION
    assert (header["precision"], header["fingerprint"], header["checksum"]) == ("u8", FP, snap.checksum())


def old_and_new_snapshots() -> list[KVSnapshot]:
    keys, values = random_kv(40)
    layers = np.random.default_rng(3).standard_normal((2, 3, 40, 64), dtype=np.float32)  # [layers, heads, T, dim]
    key_blocks = np.stack([BlockLayout("by_token", 32, 64).quantize(kv, 2) for kv in layers])
    value_blocks = np.stack([BlockLayout("by_channel", 32, 64).quantize(kv, 2) for kv in layers])
    return [
        *(KVSnapshot.from_float(range(40), keys, values, precision=p, fingerprint=FP) for p in ("f32", "f16", "u8")),
        KVSnapshot.from_float(range(40), as_bf16(keys), as_bf16(values), fingerprint=FP, shifted=True),
        KVSnapshot.from_float(range(40), keys, values, fingerprint=FP, lossless=False).prefix(33),
        KVSnapshot.from_blocks(range(40), key_blocks, value_blocks, block_tokens=32, fingerprint=FP),
    ]


@pytest.mark.parametrize("index", range(6))
def test_files_in_the_older_raw_format_restore_bit_for_bit(tmp_path: Path, index: int) -> None:
    snap = old_and_new_snapshots()[index]
    write_legacy(snap, tmp_path / "old.agkv")
    assert (tmp_path / "old.agkv").read_bytes()[:8] == b"AGKVSNAP"
    loaded = KVSnapshot.from_file(tmp_path / "old.agkv", expected_fingerprint=FP)
    snap.to_file(tmp_path / "new.agkv")
    rewritten = KVSnapshot.from_file(tmp_path / "new.agkv", expected_fingerprint=FP)
    for back in (loaded, rewritten):
        assert back.checksum() == snap.checksum()
        assert (back.tokens, back.precision, back.shifted, back.lossless, back.block_tokens) == (
            snap.tokens, snap.precision, snap.shifted, snap.lossless, snap.block_tokens)
        for name in ("keys", "values", "key_scale", "key_zero", "value_scale", "value_zero"):
            a, b = getattr(back, name), getattr(snap, name)
            assert (a is None and b is None) or (a.dtype == b.dtype and np.array_equal(a, b))
        assert all(np.array_equal(x.view(np.uint32), y.view(np.uint32))
                   for x, y in zip(back.to_float(), snap.to_float()))


@pytest.mark.parametrize("where", ["header", "payload", "last"])
def test_a_flipped_byte_in_an_older_raw_file_is_corrupt(tmp_path: Path, where: str) -> None:
    path = tmp_path / "old.agkv"
    write_legacy(make("u8"), path)
    data = bytearray(path.read_bytes())
    offset = {"header": 40, "payload": len(data) // 2, "last": len(data) - 1}[where]
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(SnapshotCorrupt, match="delete it"):
        KVSnapshot.from_file(path)


def test_every_single_byte_flip_of_a_small_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "s.agkv"
    make("u8", 2).to_file(path)
    data = path.read_bytes()
    for offset in range(len(data)):
        damaged = bytearray(data)
        damaged[offset] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises((SnapshotCorrupt, SnapshotIncompatible)):
            KVSnapshot.from_file(path)


@pytest.mark.parametrize("lie", [{"shape": [1 << 40]}, {"shape": [1 << 62, 4]}, {"dtype": "<U"},
                                 {"dtype": "V1099511627776"}, {"shape": 5}])
def test_an_old_file_whose_header_lies_about_an_array_is_refused_as_corrupt(tmp_path, lie):
    """A lying size or dtype in a format 1-2 header must not become a MemoryError or ValueError
    (a resume re-prefills only on SnapshotCorrupt / SnapshotIncompatible)."""
    import struct

    keys = np.random.default_rng(0).random((2, 1, 2, 5, 4), dtype=np.float32)
    snapshot = KVSnapshot.from_float(tuple(range(5)), keys, keys.copy(), precision="f32", fingerprint="fp",
                                     shifted=False, lossless=True)
    path = tmp_path / "old.agkv"
    write_legacy(snapshot, path)
    raw = path.read_bytes()
    magic, version, header_len = struct.unpack("<8sII", raw[:16])
    header = json.loads(raw[16:16 + header_len])
    header["arrays"][1].update(lie)
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<8sII", magic, version, len(body)) + body + raw[16 + header_len:])
    with pytest.raises(SnapshotCorrupt):
        KVSnapshot.from_file(path)
