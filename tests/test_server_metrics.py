"""GET /metrics on the scripted engine: Prometheus text the prometheus_client parser reads, with the
model-server protocol's names for queued/running requests and KV-cache use, values that move with
the requests — read from the counters the server and the engine keep, on scrape."""

from __future__ import annotations

import anyio
import httpx
from prometheus_client.parser import text_string_to_metric_families

from agentkv.observe.metrics import KV_CACHE_USAGE, QUEUED_REQUESTS, RUNNING_REQUESTS
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

KEY = "sk-test"
CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hi"}], "temperature": 0}


def client_for(engine: ScriptedEngine) -> httpx.AsyncClient:
    app = create_app(engine, api_key=KEY, model_id="scripted")
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                             headers={"Authorization": f"Bearer {KEY}"})


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """Every sample of ``GET /metrics`` (sent without the key: scrapers carry none), by name."""
    response = await client.get("/metrics", headers={"Authorization": ""})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {sample.name: sample.value for family in text_string_to_metric_families(response.text)
            for sample in family.samples}


async def test_metrics_carry_the_protocol_names_and_move_with_a_request():
    engine = ScriptedEngine(["Hello there, how can I help?"], num_slots=64)  # its slots are its KV blocks
    async with client_for(engine) as client:
        before = await scrape(client)
        assert before[QUEUED_REQUESTS] == 0 and before[RUNNING_REQUESTS] == 0
        assert before[KV_CACHE_USAGE] == 0 and before["agentkv_kv_blocks_free"] == 64
        assert before["agentkv_model_steps_total"] == 0 and before["agentkv_live_conversations"] == 0
        assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200
        after = await scrape(client)
    assert after["agentkv_model_steps_total"] == 1 and after["agentkv_live_conversations"] == 1
    assert after["agentkv_kv_blocks_used"] >= 1
    # the conversation is idle now: its KV stays, evictable, and counts as not in use (as vLLM's)
    assert after[KV_CACHE_USAGE] == 0 and after["agentkv_kv_blocks_evictable"] == after["agentkv_kv_blocks_used"]
    assert after["agentkv_kv_blocks_free"] == 64 - after["agentkv_kv_blocks_used"]
    assert after["agentkv_prefix_cache_hit_tokens_total"] == 0
    engine.assert_complete()


async def test_a_request_counts_as_running_while_it_generates():
    engine = ScriptedEngine(["a long answer " * 5], decode_s_per_token=0.02)
    async with client_for(engine) as client:
        async def slow() -> None:
            assert (await client.post("/v1/chat/completions", json=CHAT)).status_code == 200

        async with anyio.create_task_group() as tg:
            tg.start_soon(slow)
            await anyio.sleep(0.2)
            seen = await scrape(client)
        assert seen[RUNNING_REQUESTS] == 1 and seen[QUEUED_REQUESTS] == 0
        assert seen[KV_CACHE_USAGE] == 1 / 16 and seen["agentkv_kv_blocks_evictable"] == 0  # its slot runs
        assert (await scrape(client))[RUNNING_REQUESTS] == 0


async def test_an_idle_engine_shows_the_requests_and_its_counters_at_rest():
    async with client_for(ScriptedEngine([])) as client:
        samples = await scrape(client)
    assert set(samples) == {QUEUED_REQUESTS, RUNNING_REQUESTS, "agentkv_live_conversations", KV_CACHE_USAGE,
                            "agentkv_kv_blocks_used", "agentkv_kv_blocks_free", "agentkv_kv_blocks_evictable",
                            "agentkv_model_steps_total",
                            "agentkv_prefix_cache_hit_tokens_total", "agentkv_snapshot_saves_total",
                            "agentkv_snapshot_restores_total", "agentkv_prompt_cached_tokens_total"}
    assert samples["agentkv_kv_blocks_free"] == 16 and samples["agentkv_model_steps_total"] == 0
