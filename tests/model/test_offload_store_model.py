"""Offload through the KV store on the real default model: with a Runtime over a Store, an idle
conversation's offload finds every full block its turn-end save wrote (it writes none again), shares
one host tier with the store, and the next turn restores it and prefills only its new tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.memory import Store

pytestmark = pytest.mark.model

ANSWER = GenerationConfig(max_new_tokens=8)
RULES = ("You are a careful assistant. Answer in one short sentence. Never use lists. Quote numbers exactly. "
         "Say when you do not know. Keep a neutral tone. Do not repeat the question. ") * 2


async def test_an_idle_conversation_offloads_into_the_store_blocks_its_save_wrote_and_comes_back(
        engine, tmp_path: Path) -> None:
    store = Store(f"sqlite:///{tmp_path / 'o.db'}", snapshot_dir=tmp_path / "kv")
    runtime = Runtime(engine, store)
    offloads = engine.backend.pool.host
    try:
        assert offloads.blocks is store.blocks  # one host tier for saved snapshots and offloaded sessions
        conversation = await runtime.open_conversation(Agent(name="o", instructions=RULES, generation=ANSWER))
        await runtime.run(conversation, "Rivers carve valleys slowly. Why?")
        session, pool = conversation.kv, engine.backend.pool
        held = len(session.tokens)
        while pool.is_bound(session):  # offload idle sessions, least recently used first, until ours goes
            before = offloads.stats()  # NOTE: other tests' idle sessions on this engine go first
            assert await pool.offload_idle()
        after = offloads.stats()
        assert after.offloads > before.offloads and session.held_kv is not None
        receipt = session.held_kv
        assert getattr(receipt, "keys", None) is not None and len(receipt.keys) == held // 32
        # its turn-end save wrote every full block: the offload wrote none of them again
        assert after.stored_blocks - before.stored_blocks == held // 32
        assert after.new_bytes == before.new_bytes
        result = await runtime.run(conversation, "And glaciers?")
        first_call = result.call_metrics[0]
        assert first_call.restored_tokens == held and first_call.reused_tokens == held
        assert offloads.stats().reprefilled_tokens == before.reprefilled_tokens
    finally:
        await runtime.aclose()
        await store.close()
