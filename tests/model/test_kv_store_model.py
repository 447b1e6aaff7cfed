"""The KV store on the real default model: a turn writes only its new blocks, conversations sharing a
system prompt store its blocks once, and a conversation whose last blocks were lost restores the
rest and re-prefills only those."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.memory import Store
from agentkv.kvstore.block_files import DiskBlocks

pytestmark = pytest.mark.model

ANSWER = GenerationConfig(max_new_tokens=12)
TURNS = ("Rivers carve valleys slowly, moving sediment from the mountains down to the sea. Why?",
         "The library extended its opening hours during the examination period. Good idea?",
         "Engineers measured the bridge's vibration under different wind speeds. What did they find?")
RULES = ("You are a careful assistant. Answer in one short sentence. Never use lists. Quote numbers exactly. "
         "Say when you do not know. Keep a neutral tone. Do not repeat the question. ") * 2


def disk(store: Store) -> DiskBlocks:
    return next(t for t in store.blocks.tiers if isinstance(t, DiskBlocks))


async def test_each_turn_writes_the_kv_of_its_new_tokens_and_at_most_one_block_more(
        engine, tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshot_dir=tmp_path / "kv")
    runtime = Runtime(engine, store)
    try:
        conversation = await runtime.open_conversation(Agent(name="a", instructions="Be brief.", generation=ANSWER))
        held = written = 0
        for text in TURNS:
            await runtime.run(conversation, text)
            assert store.blocks.flush(30)
            record = (await store.snapshots(conversation.id))[0]
            usage = store.blocks.usage().write_behind
            assert usage is not None and usage.failed_blocks == 0
            new_blocks = usage.written_blocks - written
            # the blocks this turn completed, no block of an earlier turn again
            assert new_blocks == len(record.block_keys) - held
            held, written = len(record.block_keys), usage.written_blocks
            assert record.num_tokens - 32 * held < 32  # the file keeps less than a block
        assert len(list(disk(store).listing())) == held
    finally:
        await runtime.aclose()
        await store.close()


async def test_conversations_sharing_a_system_prompt_store_its_full_blocks_once(engine, tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'b.db'}", snapshot_dir=tmp_path / "kv")
    runtime = Runtime(engine, store)
    try:
        agent = Agent(name="rules", instructions=RULES, generation=ANSWER)
        records = []
        for text in TURNS[:3]:
            conversation = await runtime.open_conversation(agent)
            await runtime.run(conversation, text)
            records.append((await store.snapshots(conversation.id))[0])
            await runtime.close_conversation(conversation)
        shared = set(records[0].block_keys) & set(records[1].block_keys) & set(records[2].block_keys)
        assert len(shared) >= 2, "the system prompt's full blocks are one set of keys"
        own = [set(r.block_keys) - shared for r in records]
        assert not (own[0] & own[1]) and not (own[1] & own[2])
        assert store.blocks.flush(30)
        assert len(list(disk(store).listing())) == len(shared) + sum(len(o) for o in own)
    finally:
        await runtime.aclose()
        await store.close()


async def test_lost_last_blocks_restore_the_rest_and_only_those_are_prefilled(paged_exact, tmp_path: Path) -> None:
    url, kv = f"sqlite:///{tmp_path / 'c.db'}", tmp_path / "kv"
    store = Store(url, snapshot_dir=kv)
    runtime = Runtime(paged_exact, store)
    agent = Agent(name="a", instructions="Be brief.", generation=ANSWER)
    conversation = await runtime.open_conversation(agent)
    for text in TURNS:
        await runtime.run(conversation, text)
    record = (await store.snapshots(conversation.id))[0]
    await runtime.aclose()
    await store.close()
    assert len(record.block_keys) >= 3
    lost = record.block_keys[-2:]  # as a crash would lose them from the write-behind queue
    DiskBlocks(kv / "blocks").remove(lost)

    later = Store(url, snapshot_dir=kv, kv_host_bytes=0)
    resumed = Runtime(paged_exact, later)
    try:
        again = await resumed.resume(conversation.id, agent)
        kept = (len(record.block_keys) - 2) * 32
        assert again.resume_report.restored_tokens == kept
        assert again.resume_report.restored_from == {"disk": kept}  # the tail file is not used past a lost block
        result = await resumed.run(again, "One more sentence, please.")
        metrics = result.call_metrics[0]
        assert metrics.reused_tokens + metrics.prefix_cache_tokens >= kept
        assert metrics.prefilled_tokens == metrics.prompt_tokens - metrics.reused_tokens - metrics.prefix_cache_tokens
    finally:
        await resumed.aclose()
        await later.close()


@pytest.mark.parametrize("which", ["engine", "paged_exact"])
async def test_a_snapshot_from_a_block_bound_is_that_span_of_the_whole_snapshot(which, request) -> None:
    chosen = request.getfixturevalue(which)
    session = await chosen.open_session()
    try:
        await session.prefill((chosen.tokenizer.encode(" ".join(TURNS)) * 4)[:150])
        whole = await session.snapshot()
        for start in (32, 96, 128):
            part, ref = await session.snapshot(start=start), whole.span(start, whole.num_tokens)
            assert part.tokens == ref.tokens and part.cuts == ref.cuts and part.precision == ref.precision
            assert all(np.array_equal(a, b) for a, b in zip(part.to_float(), ref.to_float()))
    finally:
        await session.close()
