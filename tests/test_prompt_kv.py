"""KV found by a prompt's tokens (conversations sent whole, no session row): any store on the same
tiers restores the longest indexed prefix, one chain at a time, and prune forgets what went unused."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.kvstore.block_files import DiskBlocks
from agentkv.memory.prompt_kv import load_prompt_kv, save_prompt_kv
from agentkv.memory.schema import utcnow

FP = "test-model:kv=f32"
SPACE = KVNamespace(salt="", fingerprint=FP, layout="paged", precision="f32", numerics="exact", chunk_size=64)
TOKENS = tuple(int(t) for t in np.random.default_rng(3).integers(1, 30000, 300))


def kv_of(tokens: tuple[int, ...], cuts: tuple[int, ...] = (), scale: float = 1.0) -> KVSnapshot:
    mix = np.cumsum(np.asarray(tokens, dtype=np.float64)) % 997
    keys = (np.cos(mix[None, None, None, :, None] * np.arange(1, 5)) * scale).astype(np.float32).repeat(2, axis=2)
    return KVSnapshot.from_float(tokens, keys, -keys, precision="f32", fingerprint=FP, cuts=cuts)


@pytest.fixture
async def stores(store_url: str, tmp_path: Path):
    writer = Store(store_url, snapshot_dir=tmp_path / "kv")
    reader = Store(store_url, snapshot_dir=tmp_path / "kv", kv_host_bytes=0)  # another replica: nothing in memory
    yield writer, reader
    await writer.close()
    await reader.close()


async def test_another_store_restores_the_full_blocks_of_a_prompt_it_never_saw(stores) -> None:
    writer, reader = stores
    snap = kv_of(TOKENS[:200], cuts=(120, 121, 122))
    assert await save_prompt_kv(writer, SPACE, snap) == 6
    prompt = TOKENS[:200] + (7, 8, 9)  # the next turn: the history and a new message
    found = await load_prompt_kv(reader, SPACE, prompt)
    assert found is not None and sum(found.restored_from.values()) == 192  # each token from one tier
    got = found.snapshot
    assert got.tokens == TOKENS[:192] and got.cuts == (120, 121, 122)
    assert all(np.array_equal(a, b) for a, b in zip(got.to_float(), snap.prefix(192).to_float()))


async def test_a_prompt_that_departs_midway_gets_the_blocks_before_it(stores) -> None:
    writer, reader = stores
    await save_prompt_kv(writer, SPACE, kv_of(TOKENS[:200]))
    edited = TOKENS[:100] + (1,) + TOKENS[101:200]
    found = await load_prompt_kv(reader, SPACE, edited)
    assert found is not None and found.snapshot.num_tokens == 96


async def test_two_ways_of_computing_the_same_tokens_are_never_mixed(stores) -> None:
    writer, reader = stores
    prefill = kv_of(TOKENS[:128])
    decoded = kv_of(TOKENS[:128], cuts=tuple(range(1, 128)), scale=0.5)  # other cuts in every block: other bits
    await save_prompt_kv(writer, SPACE, prefill)
    await save_prompt_kv(writer, SPACE, decoded)
    found = await load_prompt_kv(reader, SPACE, TOKENS[:128])
    assert found is not None and found.snapshot.num_tokens == 128
    got = found.snapshot
    source = decoded if got.cuts else prefill  # one chain: the newest, whichever it is, whole
    assert all(np.array_equal(a, b) for a, b in zip(got.to_float(), source.to_float()))


async def test_another_tenant_finds_nothing(stores) -> None:
    writer, reader = stores
    await save_prompt_kv(writer, SPACE, kv_of(TOKENS[:128]))
    assert await load_prompt_kv(reader, dataclasses.replace(SPACE, salt="tenant-b"), TOKENS[:128]) is None


async def test_kv_that_cannot_be_keyed_is_not_saved(stores) -> None:
    writer, reader = stores
    plain = kv_of(TOKENS[:64])
    unknown = KVSnapshot.from_float(plain.tokens, *plain.to_float(), precision="f32", fingerprint=FP)
    assert await save_prompt_kv(writer, SPACE, unknown) == 0
    assert await load_prompt_kv(reader, SPACE, TOKENS[:64]) is None


async def test_prune_forgets_unused_prompts_and_collects_their_blocks(stores, tmp_path: Path, monkeypatch) -> None:
    writer, _ = stores
    await save_prompt_kv(writer, SPACE, kv_of(TOKENS[:96]))
    assert writer.blocks.flush(10)
    await writer.prune(orphans_older_than=timedelta(0))
    assert len(list(DiskBlocks(tmp_path / "kv" / "blocks").listing())) == 3  # still in use: kept
    later = utcnow() + timedelta(days=8)
    monkeypatch.setattr("agentkv.memory.store.utcnow", lambda: later)
    writer.clock = lambda: later
    await writer.prune(orphans_older_than=timedelta(0))
    assert list(DiskBlocks(tmp_path / "kv" / "blocks").listing()) == []
    assert await load_prompt_kv(writer, SPACE, TOKENS[:96]) is None


async def test_kept_answer_tokens_are_found_by_any_store_and_expire_with_the_prompts(stores, monkeypatch) -> None:
    from agentkv.memory.prompt_kv import find_answer_tokens, keep_answer_tokens

    writer, reader = stores
    await keep_answer_tokens(writer, {"a" * 64: [5, 6, 7], "b" * 64: [9]})
    await keep_answer_tokens(writer, {"a" * 64: [5, 6, 7]})  # kept again: touched, not duplicated
    assert await find_answer_tokens(reader, ["a" * 64, "c" * 64]) == {"a" * 64: (5, 6, 7)}
    later = utcnow() + timedelta(days=8)
    monkeypatch.setattr("agentkv.memory.store.utcnow", lambda: later)
    writer.clock = lambda: later
    await writer.prune()
    assert await find_answer_tokens(reader, ["a" * 64, "b" * 64]) == {}
