"""Run a sync tool on a daemon thread: a tool that hangs past its timeout never keeps the process alive.

``anyio.to_thread`` and ``asyncio.to_thread`` use worker threads the interpreter joins at exit,
so one tool stuck in a blocking call (a read with no timeout, a sleep) delayed exit long after
its run had returned a timeout result. Here each call gets its own daemon thread; a cancelled
(timed-out) wait abandons it, and the interpreter exits without waiting for it::

    result = await run_on_daemon_thread(functools.partial(fetch, url))
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")


async def run_on_daemon_thread(call: Callable[[], T], *, name: str = "agentkv-tool") -> T:
    """``call()`` on a new daemon thread (in a copy of the caller's context); its result, or what
    it raised. Cancelling the wait abandons the thread: it runs on, and exit does not wait for it."""
    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    results: list[T] = []
    errors: list[BaseException] = []
    context = contextvars.copy_context()

    def work() -> None:
        try:
            results.append(context.run(call))
        except BaseException as error:  # handed to the awaiting task, which raises it
            errors.append(error)
        try:
            anyio.from_thread.run_sync(done.set, token=token)
        except RuntimeError:  # the event loop is gone: nobody waits any more
            pass

    threading.Thread(target=work, name=name, daemon=True).start()
    await done.wait()
    if errors:
        raise errors[0]
    return results[0]
