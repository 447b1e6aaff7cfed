"""The server's KV block collector: every few minutes, blocks no snapshot or prompt index names leave the tiers.

Without it an object store with no lifecycle rules would only grow: blocks outlive the rows that
named them (a pruned snapshot, an expired prompt index). Each pass is ``Store.prune()`` with no
session or snapshot retention: it expires unused prompt-index rows, removes orphaned snapshot files
and collects unreferenced blocks older than the store's grace (never one a save is writing)::

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(collect_blocks_every, store, 600.0)
        ...
        tasks.cancel_scope.cancel()
"""

from __future__ import annotations

import logging

import anyio

from agentkv.memory import Store

__all__ = ["COLLECT_INTERVAL_S", "collect_blocks_every"]

COLLECT_INTERVAL_S = 600.0
"""Seconds between two collections (the first comes one interval after start)."""

logger = logging.getLogger("agentkv.server")


async def collect_blocks_every(store: Store, interval_s: float = COLLECT_INTERVAL_S) -> None:
    """Collect the store's unreferenced KV blocks every ``interval_s`` seconds until cancelled; a
    failed pass is one warning (the next one retries)."""
    while True:
        await anyio.sleep(interval_s)
        try:
            report = await store.prune()
        except Exception as error:  # NOTE: a store that cannot be reached now is tried again next time
            logger.warning("collecting unreferenced KV blocks failed (%s: %s); retrying in %.0f s",
                           type(error).__name__, error, interval_s)
            continue
        if report.bytes_freed:
            logger.info("collected %.1f MB of unreferenced KV blocks and snapshot files", report.bytes_freed / 1e6)
