"""Slot offload on the real model: 8 sessions on 2 slots, the host byte budget (disk / drop), fork, snapshot errors.

Every session plants its own "needle" word; its greedy outputs must equal its solo run and
never show another session's needle (no KV cross-talk), and the metrics must show restores,
not re-prefills. Eight sessions on two slots already make every session but the last two wait
for a slot, be offloaded between its turns and restored, in a different order for turn 2; 20
(as before) repeated those paths for twice the CPU time.

The tests here run the real model; the scripted ones are in ``tests/test_offload.py``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import anyio
import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.session.offload_store import OffloadStore
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible
from agentkv.kv.snapshot import KVSnapshot

pytestmark = pytest.mark.model


NEEDLES = ["mango", "violet", "anchor", "falcon", "copper", "tulip", "glacier", "pepper", "saturn", "walnut",
           "harbor", "cobalt"]
"""One needle per session of the tests below (concurrent: the first 8; spill, drop, corrupt: 5, 4, 3)."""


CONCURRENT = NEEDLES[:8]


CFG = GenerationConfig(max_new_tokens=4)


TURN_2 = "\nQ: And once more, what is the secret word?\nA: The secret word is"


@pytest.fixture(scope="session")
def offload_engine():
    """Exact numerics on 2 slots (the invariant gaps below are then ~1e-5 on any CPU); no prefix
    cache, to isolate offload. Default numerics are covered by tests/model/test_restore_equivalence.py."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=2, exact=True, prefix_cache_bytes=0)


PREAMBLE = ("A game of memory: the user says one secret word, and whenever the user asks for it, the answer is that "
            "word, exactly as it was said, with nothing else. The word can be any word at all. ")
"""With it a first prompt is ~68 tokens: two full 32-token blocks, so offloads keep blocks, not tails only."""


def first_prompt(engine, needle: str) -> list[int]:
    return engine.tokenizer.encode(f"{PREAMBLE}\nSecret word: {needle}.\nQ: What is the secret word?\n"
                                   "A: The secret word is")


def second_prompt(engine, session_tokens, answer) -> list[int]:
    return list(session_tokens) + list(answer[-1:]) + engine.tokenizer.encode(TURN_2)


async def two_turns(engine, session, needle: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    one = await session.generate(first_prompt(engine, needle), CFG)
    two = await session.generate(second_prompt(engine, session.tokens, one.token_ids), CFG)
    return one.token_ids, two.token_ids


@pytest.fixture(scope="module")
def solo_runs(offload_engine):
    """Each needle's two answers from a session that had the pool to itself."""

    async def run() -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
        runs = {}
        for needle in NEEDLES:
            s = await offload_engine.open_session()
            runs[needle] = await two_turns(offload_engine, s, needle)
            await s.close()
        return runs

    return anyio.run(run)


def assert_no_cross_talk(engine, outputs: dict[str, tuple[int, ...]]) -> None:
    """No answer names another session's needle."""
    for needle, ids in outputs.items():
        text = engine.tokenizer.decode(list(ids)).lower()
        assert not [other for other in NEEDLES if other != needle and other in text], (needle, text)


async def test_concurrent_sessions_on_two_slots_match_their_solo_runs_and_are_restored(offload_engine, solo_runs):
    engine = offload_engine
    sessions = {needle: await engine.open_session() for needle in CONCURRENT}
    offloads_before = engine.pool.offloads
    answers: dict[str, list] = {needle: [] for needle in CONCURRENT}
    metrics = {}

    async def turn_one(needle: str) -> None:
        answers[needle].append((await sessions[needle].generate(first_prompt(engine, needle), CFG)).token_ids)

    async def turn_two(needle: str) -> None:
        s = sessions[needle]
        result = await s.generate(second_prompt(engine, s.tokens, answers[needle][0]), CFG)
        answers[needle].append(result.token_ids)
        metrics[needle] = result.metrics

    async with anyio.create_task_group() as tg:  # 8 concurrent first turns on 2 slots
        for needle in CONCURRENT:
            tg.start_soon(turn_one, needle)
    logs = {needle: len(s.tokens) for needle, s in sessions.items()}
    async with anyio.create_task_group() as tg:
        for needle in reversed(CONCURRENT):
            tg.start_soon(turn_two, needle)

    assert {n: tuple(a) for n, a in answers.items()} == {n: solo_runs[n] for n in CONCURRENT}
    assert_no_cross_talk(engine, {n: a[0] + a[1] for n, a in answers.items()})
    named = sum(n in engine.tokenizer.decode(list(solo_runs[n][1])) for n in CONCURRENT)
    assert named >= len(CONCURRENT) // 2  # the needles are actually repeated, so the cross-talk check means something
    for needle, m in metrics.items():  # the second turn prefilled only its new tokens
        assert m.reused_tokens == logs[needle] and m.prefilled_tokens == m.prompt_tokens - logs[needle]
    restored = [n for n, m in metrics.items() if m.restored_tokens == logs[n]]
    assert len(restored) >= len(CONCURRENT) - engine.pool.size  # all but those still holding a slot
    assert engine.pool.offloads - offloads_before >= 2 * len(CONCURRENT) - 2 * engine.pool.size
    for s in sessions.values():
        await s.close()


async def run_on_store(engine, needles: list[str]) -> dict[str, list]:
    """First turns for every needle, then second turns: each session is offloaded in between."""
    sessions = {n: await engine.open_session() for n in needles}
    out: dict[str, list] = {}
    for n in needles:
        out[n] = [(await sessions[n].generate(first_prompt(engine, n), CFG)).token_ids]
    for n in needles:
        s = sessions[n]
        result = await s.generate(second_prompt(engine, s.tokens, out[n][0]), CFG)
        out[n] += [result.token_ids, result.metrics]
    for s in sessions.values():
        await s.close()
    return out


async def test_over_the_host_budget_offloaded_kv_spills_to_disk_and_comes_back(
    offload_engine, solo_runs, tmp_path, monkeypatch
):
    one_session = 80 * offload_engine.kv_bytes_per_token()  # f32 blocks: ~1 session fits
    store = OffloadStore(budget_bytes=one_session, spill_dir=tmp_path, namespace_for=offload_engine.kv_namespace)
    monkeypatch.setattr(offload_engine.pool, "host", store)
    needles = NEEDLES[:5]
    out = await run_on_store(offload_engine, needles)
    for n in needles:
        assert (out[n][0], out[n][1]) == solo_runs[n]
    stats = store.stats()
    host, disk = stats.tiers
    # what left memory came back from the disk tier, and nothing was re-prefilled
    assert host.evicted_blocks >= 2 and disk.hits >= 2 and stats.reprefilled_tokens == 0
    assert sum(out[n][2].restored_tokens > 0 for n in needles) >= len(needles) - 2
    store.blocks.flush(5.0)
    host, disk = store.stats().tiers
    assert stats.held == 0 and host.blocks == disk.blocks == 0  # closed: no block left behind
    store.close()


async def test_without_a_spill_dir_over_budget_kv_is_dropped_and_re_prefilled_correctly(
    offload_engine, solo_runs, monkeypatch
):
    store = OffloadStore(budget_bytes=0, namespace_for=offload_engine.kv_namespace)
    monkeypatch.setattr(offload_engine.pool, "host", store)
    needles = NEEDLES[5:9]
    out = await run_on_store(offload_engine, needles)
    for n in needles:
        assert (out[n][0], out[n][1]) == solo_runs[n]
    # only the tails (< 32 tokens, kept with each receipt) came back; the blocks were re-prefilled
    # and counted as prefilled, never as reused
    offloaded = [n for n in needles if out[n][2].restored_tokens or out[n][2].prefilled_tokens > 40]
    assert len(offloaded) >= len(needles) - 2
    for n in offloaded:
        m = out[n][2]
        assert m.restored_tokens < 32 and m.prefilled_tokens >= m.prompt_tokens - m.restored_tokens - 1
    stats = store.stats()
    assert stats.reprefilled_tokens >= 64 * len(offloaded) and stats.tiers[0].nbytes == 0


async def test_a_corrupted_block_on_disk_is_never_loaded_the_session_re_prefills(
    offload_engine, solo_runs, tmp_path, monkeypatch
):
    engine = offload_engine
    store = OffloadStore(budget_bytes=0, spill_dir=tmp_path, namespace_for=engine.kv_namespace)
    monkeypatch.setattr(engine.pool, "host", store)
    needles = NEEDLES[9:12]
    sessions = {n: await engine.open_session() for n in needles}
    first = {n: (await sessions[n].generate(first_prompt(engine, n), CFG)).token_ids for n in needles}
    store.blocks.flush(5.0)
    spilled = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert spilled
    for path in spilled:  # flip a byte near the end of every block on disk so far
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(data)
    for n in needles:
        s = sessions[n]
        second = await s.generate(second_prompt(engine, s.tokens, first[n]), CFG)
        assert (first[n], second.token_ids) == solo_runs[n]
        await s.close()
    assert store.stats().reprefilled_tokens >= 64 and store.blocks.usage().corrupt_blocks >= 1
    store.close()


async def invariant_gap(engine, session) -> float:
    """Max |Δlogit| between the session's next-token logits and a one-pass prefill of its tokens."""
    logits = await session.next_token_logits()
    fresh = await engine.open_session()
    await fresh.prefill(session.tokens)
    reference = await fresh.next_token_logits()
    await fresh.close()
    return float(np.abs(logits - reference).max())


async def test_fork_branches_diverge_independently_and_each_keeps_the_invariant(offload_engine):
    engine = offload_engine
    parent = await engine.open_session()
    base = await parent.generate(first_prompt(engine, "mango"), CFG)
    child = await parent.fork()
    assert child.tokens == parent.tokens
    shared = parent.tokens
    tail = list(base.token_ids[-1:])
    a = await parent.generate(list(shared) + tail + engine.tokenizer.encode(" Then a fruit:"), CFG)
    b = await child.generate(list(shared) + tail + engine.tokenizer.encode(" Then a colour:"), CFG)
    assert parent.tokens[: len(shared)] == child.tokens[: len(shared)] == shared
    assert parent.tokens[len(shared):] != child.tokens[len(shared):]
    assert b.metrics.reused_tokens == len(shared) and a.metrics.reused_tokens == len(shared)
    grandchild = await child.fork()  # forking a branch that another session's turn may have offloaded
    for session in (parent, child, grandchild):
        assert await invariant_gap(engine, session) <= 1e-3
    for session in (parent, child, grandchild):
        await session.close()


async def test_real_snapshot_files_fail_loudly_when_truncated_or_from_another_model(offload_engine, tmp_path: Path):
    session = await offload_engine.open_session()
    await session.prefill(first_prompt(offload_engine, "walnut"))
    snap = await session.snapshot()
    path = tmp_path / "s.kvsnap"
    snap.to_file(path)
    assert KVSnapshot.from_file(path, expected_fingerprint=offload_engine.fingerprint).tokens == session.tokens
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(SnapshotCorrupt, match="truncated"):
        KVSnapshot.from_file(path, expected_fingerprint=offload_engine.fingerprint)
    with pytest.raises(SnapshotIncompatible, match="re-prefill"):
        await session.restore(dataclasses.replace(snap, fingerprint="another-model:kv=u8"))
    assert await invariant_gap(offload_engine, session) <= 1e-3  # the failed restore changed nothing
    await session.close()
