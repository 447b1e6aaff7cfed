"""Run a ``TokenSteps`` over fake model steps through either driver: step by step on the event
loop (``loop.run_steps``) or in one worker thread (``threaded.run_steps_in_thread``)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from typing import Any

import anyio.lowlevel
import numpy as np

from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.loop import run_steps
from agentkv.engine.decode.threaded import run_steps_in_thread
from agentkv.engine.decode.model_steps import FeedRowsStep, FeedStep, ModelStep, TrimStep
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps

DRIVERS = ("event-loop", "thread")


def blocking_executor(feed: Callable[[list[int]], None], feed_rows: Callable[[list[int], int], np.ndarray],
                      trim: Callable[[int], None]) -> Callable[[ModelStep], Any]:
    """``execute(step)`` over fakes: ``feed(ids)``, ``feed_rows(ids, rows)``, ``trim(keep)`` (keep
    that many generated tokens)."""

    def execute(step: ModelStep) -> Any:
        if isinstance(step, FeedRowsStep):
            return feed_rows(step.ids, step.rows)
        if isinstance(step, FeedStep):
            return feed(step.ids)
        assert isinstance(step, TrimStep)
        return trim(step.keep)

    return execute


def drive(steps: TokenSteps, execute: Callable[[ModelStep], Any], driver: str
          ) -> AsyncGenerator[TokenDelta | DecodeOutcome, None]:
    """The events of ``steps`` through ``driver`` (one of ``DRIVERS``)."""
    if driver == "thread":
        return run_steps_in_thread(steps, execute)

    async def execute_async(step: ModelStep) -> Any:
        result = execute(step)
        await anyio.lowlevel.checkpoint()  # a real step is awaited: a cancellation lands after it
        return result

    return run_steps(steps, execute_async)
