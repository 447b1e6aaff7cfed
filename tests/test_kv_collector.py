"""The server's block collector runs the store's prune on its interval and survives a failed pass."""

from __future__ import annotations

import logging

import anyio
import pytest

from agentkv.memory.records import PruneReport
from agentkv.server.kv_collector import collect_blocks_every


class CountingStore:
    def __init__(self, fail_first: bool) -> None:
        self.calls = 0
        self.fail_first = fail_first
        self.third = anyio.Event()

    async def prune(self) -> PruneReport:
        self.calls += 1
        if self.calls == 3:
            self.third.set()
        if self.fail_first and self.calls == 1:
            raise OSError("bucket unreachable")
        return PruneReport((), 0, 0, 1 << 20)


@pytest.mark.parametrize("fail_first", [False, True])
async def test_the_collector_prunes_on_its_interval_and_a_failed_pass_is_one_warning(fail_first, caplog) -> None:
    store = CountingStore(fail_first)
    with caplog.at_level(logging.WARNING, logger="agentkv.server"), anyio.fail_after(30):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(collect_blocks_every, store, 0.05)
            await store.third.wait()  # a third pass came: the loop went on after each one
            tasks.cancel_scope.cancel()
    assert store.calls == 3
    assert ("bucket unreachable" in caplog.text) is fail_first


async def test_a_served_app_with_a_store_collects_on_its_interval(tmp_path, monkeypatch) -> None:
    from agentkv.memory import Store
    from agentkv.server import create_app
    from agentkv.testing import ScriptedEngine

    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    counting = CountingStore(fail_first=False)
    monkeypatch.setattr(store, "prune", counting.prune)
    app = create_app(ScriptedEngine(), store=store, collect_interval_s=0.05)
    with anyio.fail_after(30):
        async with app.router.lifespan_context(app):
            await counting.third.wait()
    calls = counting.calls
    await anyio.sleep(0.2)
    assert counting.calls == calls  # stopped with the app
