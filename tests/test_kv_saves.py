"""Chat turns' KV saves after the answer: bounded, logged, drained on shutdown; through the server, a
chat completion is answered before its KV reaches the store, and another replica then restores it
and says in the access log which tier gave it."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import anyio
import httpx
import pytest

from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.server.kv_saves import KVSaves
from agentkv.testing import ScriptedEngine

KEY = "sk-test"


async def test_a_save_past_the_bound_waits_for_the_oldest_and_failures_are_logged_not_raised(caplog) -> None:
    saves = KVSaves(max_pending=1)
    first_done, order = asyncio.Event(), []

    async def slow() -> None:
        await first_done.wait()
        order.append("first")

    async def failing() -> None:
        order.append("second")
        raise OSError("bucket unreachable")

    await saves.start(slow())
    assert saves.pending == 1
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(saves.start, failing())  # waits: the bound is one save at a time
            await anyio.sleep(0.05)
            assert order == []
            first_done.set()
    await saves.flush()
    assert order == ["first", "second"] and saves.failed == 1 and saves.pending == 0
    assert "bucket unreachable" in caplog.text


async def test_closing_waits_for_saves_then_cancels_those_past_the_wait(caplog) -> None:
    saves = KVSaves()
    finished: list[str] = []

    async def quick() -> None:
        await asyncio.sleep(0.01)
        finished.append("quick")

    async def stuck() -> None:
        await asyncio.sleep(60)
        finished.append("stuck")

    await saves.start(quick())
    await saves.start(stuck())
    with caplog.at_level(logging.WARNING, logger="agentkv.server"):
        await saves.aclose(timeout=0.5)
    assert finished == ["quick"] and saves.pending == 0
    assert "cancelled" in caplog.text
    with pytest.raises(UserError, match="max_pending"):
        KVSaves(max_pending=0)


async def test_a_chat_turn_is_answered_before_its_kv_is_stored_and_another_replica_then_restores_it(
        tmp_path: Path, monkeypatch, caplog) -> None:
    """Two replicas on one store (SQLite file and block directory): the first answers while its save
    is held back, then writes it; the second, which never saw the conversation, restores its blocks."""
    import agentkv.server.runs as runs_module

    url = f"sqlite:///{tmp_path / 'chat.db'}"
    release = asyncio.Event()
    real_save = runs_module.save_prompt_kv

    async def held_save(*args, **kwargs):
        await release.wait()
        return await real_save(*args, **kwargs)

    monkeypatch.setattr(runs_module, "save_prompt_kv", held_save)
    history = [{"role": "user", "content": " ".join(f"word{i}" for i in range(120))}]
    body = {"model": "scripted", "temperature": 0, "max_tokens": 4}
    async with Store(url) as store:
        app = create_app(ScriptedEngine(replies=["An answer."]), store=store, api_key=KEY, model_id="scripted")
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://a",
                headers={"Authorization": f"Bearer {KEY}"}) as client:
            answer = await client.post("/v1/chat/completions", json={**body, "messages": history})
            assert answer.status_code == 200
            saves = app.state.chat.runs.saves
            assert saves.pending == 1  # answered while its KV is still to be written
            release.set()
            await saves.flush()
            assert saves.failed == 0
            text = answer.json()["choices"][0]["message"]["content"]
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
    async with Store(url) as store:
        app = create_app(ScriptedEngine(replies=["More."]), store=store, api_key=KEY, model_id="scripted")
        async with app.router.lifespan_context(app), httpx.AsyncClient(
                transport=httpx.ASGITransport(app=app), base_url="http://b",
                headers={"Authorization": f"Bearer {KEY}"}) as client:
            with caplog.at_level(logging.INFO, logger="agentkv.server.access"):
                again = await client.post("/v1/chat/completions", json={**body, "messages": history})
    assert again.status_code == 200
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 96  # the first turn's full blocks, from the store
    line = next(r.getMessage() for r in caplog.records if "/v1/chat/completions 200" in r.getMessage())
    assert "kv_from=" in line
