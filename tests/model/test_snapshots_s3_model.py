"""A conversation on the real default model, its KV snapshots in S3, resumed in a new Runtime.

Needs the S3 server of ``scripts/start_s3.sh`` (``AGENTKV_TEST_S3_URL``); skips without it."""

from __future__ import annotations

import os
import uuid

import pytest

from agentkv import Agent, Runtime
from agentkv.memory import Store

pytestmark = pytest.mark.model

AGENT = Agent(name="s3-model", instructions="You are a terse assistant.",
              generation={"max_new_tokens": 12})


async def test_a_conversation_with_s3_snapshots_resumes_with_its_kv_and_answers_as_an_uninterrupted_run(
        paged_exact, tmp_path):
    base = os.environ.get("AGENTKV_TEST_S3_URL")
    if not base:
        pytest.skip("no S3 server: set AGENTKV_TEST_S3_URL (eval \"$(bash scripts/start_s3.sh)\")")
    snapshots = f"{base.rstrip('/')}/{uuid.uuid4().hex[:12]}"
    url = f"sqlite:///{tmp_path / 'a.db'}"
    # the uninterrupted run: two turns in one runtime
    with_kv = Runtime(paged_exact, Store(url, snapshots=snapshots), agents=[AGENT])
    straight = await with_kv.open_conversation(AGENT, conversation_id="straight")
    await with_kv.run(straight, "Name three colours.")
    expected = await with_kv.run(straight, "Now name three animals.")
    # the interrupted one: turn one, the runtime closes, a new runtime and store resume it from S3
    moved = await with_kv.open_conversation(AGENT, conversation_id="moved")
    await with_kv.run(moved, "Name three colours.")
    await with_kv.aclose()
    store = Store(url, snapshots=snapshots)
    newest = (await store.snapshots("moved"))[0]
    assert str(newest.path).startswith("s3:/")
    again = Runtime(paged_exact, store, agents=[AGENT])
    resumed = await again.resume("moved")
    history = resumed.render(AGENT, add_generation_prompt=False).token_ids
    assert resumed.resume_report.restored_tokens == newest.num_tokens
    assert newest.block_keys  # saved as keyed blocks: read back in the namespace they were keyed in
    restored = await store.load_snapshot(newest, expected_fingerprint=paged_exact.fingerprint,
                                         namespace=paged_exact.kv_namespace(block_size=store.block_size))
    assert tuple(history[: newest.num_tokens]) == restored.tokens
    # NOTE: KV exists for every token fed through the model: all of the history but the last sampled
    # token (never fed) and the template's end-of-turn markup (<|im_end|>, "\n"), measured: 3 tokens
    assert len(history) - 3 <= newest.num_tokens < len(history)
    answer = await again.run(resumed, "Now name three animals.")
    await again.aclose()
    await store.close()
    assert answer.final_text == expected.final_text
