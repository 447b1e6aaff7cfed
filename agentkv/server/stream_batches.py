"""ready_batches: the items an async iterator yields back to back, without waiting in between, as
one list — so a stream can send what is ready at once in one chunk instead of one each.

The decode loop hands its deltas over in runs (``GenerationConfig.decode_run``, a confirmed draft:
several tokens from one model step), and the run's async generators then yield them one after
another without suspending. A server that sends each as its own event pays the chunk's building,
its JSON, the server-sent event's write and the client's parse once per token; taken together
they are paid once per run. Nothing waits to fill a batch: a batch ends where the iterator would
wait (for the next model step), and the items already taken go out at once.

The iterator is driven in the caller's task, exactly as ``await anext(items)`` drives it (its
cancel scopes are entered and left in that task; a cancellation reaches it where it waits). A
batch goes out while the iterator's next step waits: closing the batches there (``aclose``) lets
that step finish (for a decode run, the next model step), drops its item, and leaves the
iterator at a yield, where its owner closes it::

    async with aclosing(ready_batches(events)) as batches:
        async for batch in batches:                   # [TextDelta, TextDelta, ...]
            for delta in joined_deltas(batch):        # [TextDelta] (the texts joined)
                yield delta
"""

from __future__ import annotations

import types
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from agentkv.events import ReasoningDelta, TextDelta

T = TypeVar("T")

MAX_BATCH = 64
"""Items at most in one batch (a source that never waits still has its items sent)."""


@dataclass
class _Ready:
    """``anext`` of the source gave an item without waiting."""

    item: Any


@dataclass
class _Waiting:
    """``anext`` of the source waits on the event loop."""

    step: Generator[Any, Any, Any]
    """The ``anext`` awaitable's iterator, part-run."""
    waits_on: Any
    """What it yielded to the event loop (a future, or None for a bare checkpoint)."""


class _Ended:
    """The source has no more items."""


async def ready_batches(items: AsyncIterator[T], *, max_batch: int = MAX_BATCH) -> AsyncGenerator[list[T], None]:
    """The items of ``items`` in lists of those it yielded without waiting in between (at most
    ``max_batch`` each; never empty). See the module docstring for a call."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    batch: list[T] = []
    while True:
        try:
            started = _start(items)
        except Exception:
            if batch:  # NOTE: what the source gave before it failed goes out first, as without batching
                yield batch
            raise
        if isinstance(started, _Ended):
            if batch:
                yield batch
            return
        if isinstance(started, _Waiting):
            if batch:  # NOTE: the next item is not ready: the ready ones go out while its step waits
                try:
                    yield batch
                except BaseException:
                    await _abandon(started)
                    raise
                batch = []
            try:
                item = await _resume(started)
            except StopAsyncIteration:
                return
        else:
            item = started.item
        batch.append(item)
        if len(batch) >= max_batch:
            yield batch
            batch = []


def _start(items: AsyncIterator[Any]) -> _Ready | _Ended | _Waiting:
    """Run ``anext(items)`` until it has an item, ends, or waits on the event loop."""
    step = items.__anext__().__await__()
    try:
        waits_on = step.send(None)
    except StopIteration as done:
        return _Ready(done.value)
    except StopAsyncIteration:
        return _Ended()
    return _Waiting(step, waits_on)


@types.coroutine
def _resume(waiting: _Waiting) -> Generator[Any, Any, Any]:
    """Await the rest of a step ``_start`` left waiting, as ``await`` would: what the event loop
    sends or throws (a cancellation) goes to the step; the step's item is returned."""
    step, waits_on = waiting.step, waiting.waits_on
    while True:
        try:
            answer = yield waits_on
        except GeneratorExit:
            step.close()
            raise
        except BaseException as thrown:  # NOTE: a cancellation, delivered where the step waits
            try:
                waits_on = step.throw(thrown)
            except StopIteration as done:
                return done.value
            continue
        try:
            waits_on = step.send(answer)
        except StopIteration as done:
            return done.value


async def _abandon(waiting: _Waiting) -> None:
    """Let a waiting step finish for a consumer that left, its item dropped, so the source stops at
    a yield, where closing it runs its clean-up. (``GeneratorExit`` thrown where it waits would
    close the awaits under it at once, and a clean-up that awaits could not run.)"""
    try:
        await _resume(waiting)
    except StopAsyncIteration:
        return


def joined_deltas(batch: Sequence[T]) -> list[T]:
    """``batch`` with each run of ``TextDelta`` (their texts and log-probabilities) and of
    ``ReasoningDelta`` joined into one; other items as they are, in order::

        joined_deltas([TextDelta("Hel"), TextDelta("lo"), result])   # [TextDelta("Hello"), result]
    """
    joined: list[Any] = []
    for item in batch:
        last = joined[-1] if joined else None
        if isinstance(item, TextDelta) and isinstance(last, TextDelta):
            joined[-1] = TextDelta(last.text + item.text, last.logprobs + item.logprobs)
        elif isinstance(item, ReasoningDelta) and isinstance(last, ReasoningDelta):
            joined[-1] = ReasoningDelta(last.text + item.text)
        else:
            joined.append(item)
    return joined
