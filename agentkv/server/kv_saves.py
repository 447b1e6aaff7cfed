"""KVSaves: the store writes of chat-completion turns, after their answer has gone — off the response path.

A conversation a client resends whole keeps its KV in the store for any replica (``memory/prompt_kv.py``).
Reading the KV past the blocks the store holds needs the live session (``read_unstored_kv``, a few
milliseconds); encoding, writing the blocks, waiting for the persistent tiers and indexing them by
their tokens does not, and took 40-65 ms a turn on the response path before (measured on the default
model, avx2). The run reads, lets the session go, and hands the rest here: at most ``max_pending``
saves run at once (a new one waits for the oldest: back-pressure, not an unbounded queue), a failed
save is logged (the next turn on another replica prefills instead), and ``aclose`` waits (bounded)
for those still running when the server stops::

    saves = KVSaves(store)
    saves.start(save_prompt_kv(store, space, span, log))   # returns at once (or after the oldest)
    await saves.aclose()                                     # on shutdown
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine, Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentkv.errors import UserError

logger = logging.getLogger("agentkv.server")

DEFAULT_MAX_PENDING = 16
"""Saves running at once before a new one waits for the oldest."""
CLOSE_WAIT_S = 15.0
"""How long ``aclose`` waits for saves still running (then they are cancelled: a turn's KV lost
costs its re-prefill on the next replica, never a wrong answer)."""


class KVSaves:
    """Chat turns' KV saves running in the background. See the module docstring."""

    def __init__(self, *, max_pending: int = DEFAULT_MAX_PENDING) -> None:
        if max_pending < 1:
            raise UserError(f"max_pending must be >= 1, got {max_pending}")
        self.max_pending = max_pending
        self._running: list[asyncio.Task[Any]] = []
        self.failed = 0
        """Saves that raised (logged; the conversation's next turn elsewhere prefills instead)."""

    async def start(self, save: Coroutine[Any, Any, Any], *, what: str = "a conversation's KV") -> None:
        """Run ``save`` in the background (after waiting for the oldest save when ``max_pending``
        run already): ``await saves.start(save_prompt_kv(...))``."""
        self._running = [task for task in self._running if not task.done()]
        while len(self._running) >= self.max_pending:
            await asyncio.wait([self._running[0]])
            self._running = [task for task in self._running if not task.done()]
        task = asyncio.get_running_loop().create_task(self._logged(save, what))
        self._running.append(task)

    async def _logged(self, save: Coroutine[Any, Any, Any], what: str) -> None:
        try:
            await save
        except asyncio.CancelledError:
            raise
        except Exception as error:  # NOTE: never fails a turn: its answer has gone already
            self.failed += 1
            logger.warning("could not keep %s in the store (%s: %s)", what, type(error).__name__, error)

    @property
    def pending(self) -> int:
        """Saves still running: ``saves.pending``."""
        return sum(1 for task in self._running if not task.done())

    async def flush(self) -> None:
        """Wait until every save started so far has ended (tests; ``aclose``)."""
        running = [task for task in self._running if not task.done()]
        if running:
            await asyncio.wait(running)

    async def aclose(self, timeout: float = CLOSE_WAIT_S) -> None:
        """Wait up to ``timeout`` seconds for the saves still running, then cancel the rest."""
        running = [task for task in self._running if not task.done()]
        if not running:
            return
        done, late = await asyncio.wait(running, timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            logger.warning("%d KV save(s) still running at shutdown were cancelled (their turns re-prefill "
                           "on the next replica)", len(late))
            await asyncio.wait(late)


class KVSavesCollector(Collector):
    """``/metrics`` of the background saves: ``registry.register(KVSavesCollector(runs.saves))``
    gives ``agentkv_kv_saves_pending`` (a replica about to be stopped on purpose can wait for 0)
    and ``agentkv_kv_saves_failed_total``."""

    def __init__(self, saves: KVSaves) -> None:
        self.saves = saves

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("agentkv_kv_saves_pending", "Chat turns whose KV is still being written to the store.",
                                value=self.saves.pending)
        yield CounterMetricFamily("agentkv_kv_saves_failed", "Chat turns whose KV could not be kept in the store.",
                                  value=self.saves.failed)
