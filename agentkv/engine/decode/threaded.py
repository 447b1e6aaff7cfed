"""Run a call's token loop in one worker thread; the event loop only receives its deltas.

Stepping one token at a time from the event loop costs a thread hop and an event-loop wake per
token (~0.7 ms of Python between two model steps on a 2-core CPU; measured, issue 27). Here the
whole loop — feed, choose, detokenize, stop — runs in one thread, as openvino-genai's C++ loop
does, and each delta is handed to the event loop without the thread waiting for it
(``thread_channel``): the consumer's work overlaps the next model step. The deltas the loop yields
between two model steps (a run's, ``RunStep``) go over as one hand-over, one event-loop wake; before
a run, it happens once the run's first step is under way (``RunStep.started``), so the wake and the
event loop's share of the work overlap the model's, not the thread's Python between steps. The
thread runs at most ``DELTAS_AHEAD`` deltas (and a run) ahead of its consumer. A stream closed or
cancelled stops the thread after the step it is in (a run: after its current token), and the KV
log is then settled to what one-by-one decoding's log holds after the last delta the consumer
received (the thread may have fed tokens beyond it). No OpenVINO here::

    events = run_steps_in_thread(TokenSteps(choose, config=cfg, ...), execute_blocking)
    async with aclosing(events):
        async for event in events:          # TokenDelta ..., then the DecodeOutcome
            ...
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, replace
from typing import Any

import anyio
import anyio.lowlevel

from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.model_steps import MODEL_STEPS, ModelStep, RunStep
from agentkv.engine.decode.thread_channel import ThreadChannel
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps

try:
    import sniffio
except ImportError:  # pragma: no cover - anyio works without it
    sniffio = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

DELTAS_AHEAD = 8
"""Deltas the thread may have produced that its consumer has not taken, plus one run's
(``GenerationConfig.decode_run``: a run's deltas go over together, and the next run starts before
the hand-over after it waits): a stream paused (or left open) costs at most that many tokens of
decoding, and a cancel waits for none of them."""


@dataclass(frozen=True)
class _Delta:
    event: TokenDelta | DecodeOutcome
    kept: int
    """Generated tokens one-by-one decoding's log held when the loop yielded ``event``."""


@dataclass(frozen=True)
class _Deltas:
    """The deltas the loop yielded between two model steps, in order."""

    deltas: list[_Delta]


@dataclass(frozen=True)
class _Finished:
    error: BaseException | None


async def run_steps_in_thread(steps: TokenSteps, execute: Callable[[ModelStep], Any]
                              ) -> AsyncGenerator[TokenDelta | DecodeOutcome, None]:
    """Drive ``steps`` in a new worker thread, running ``execute(step)`` there for each model
    step: a ``TokenDelta`` per token, then the outcome, as ``loop.run_steps`` yields them. However
    the stream ends, the KV log then holds what one-by-one decoding's would at the last event the
    consumer received (a step that failed while the consumer still read: where it failed),
    settled shielded from a cancellation; skipped, like ``run_steps``'s, when another task closes
    the stream. See the module docstring for a call."""
    channel: ThreadChannel[_Deltas | _Finished] = ThreadChannel(DELTAS_AHEAD)
    stop = threading.Event()

    def interrupted(step: RunStep, started: Callable[[], None] | None) -> RunStep:
        """``step`` ending after the token it is at once the stream stops, calling ``started``."""
        ends = step.ends
        return replace(step, ends=lambda token: ends(token) or stop.is_set(), started=started)

    def handover(batch: list[_Delta]) -> Callable[[], None]:
        """``post()``: hand ``batch`` to the consumer, once (later calls do nothing; no waiting)."""
        held = [batch]

        def post() -> None:
            if held:
                deltas = held.pop()
                channel.post(_Deltas(deltas), size=len(deltas), wait=False)

        return post

    def work() -> None:
        error: BaseException | None = None
        ready: list[_Delta] = []
        try:
            run = steps.run()
            try:
                reply: Any = None
                while True:
                    try:
                        item = run.send(reply)
                    except StopIteration:
                        break
                    if isinstance(item, MODEL_STEPS):
                        post = handover(ready) if ready else None
                        ready = []
                        if post is not None:
                            channel.wait_for_room()  # NOTE: the lead is waited for here, outside the model's lock
                        stopping = stop.is_set()
                        # NOTE: a run posts while its first step holds the model's lock: only where
                        # posting never waits for the event loop (asyncio), else before the run
                        if post is not None and (stopping or not isinstance(item, RunStep)
                                                 or not channel.posts_without_waiting):
                            post()
                        if stopping:
                            break
                        if not isinstance(item, RunStep):
                            reply = execute(item)
                            continue
                        try:  # NOTE: a run's first step calls post() while it computes: the consumer's
                            reply = execute(interrupted(item, post))  # share of the hand-over overlaps it
                        finally:
                            if post is not None:
                                post()
                    else:
                        reply = None
                        ready.append(_Delta(item, steps.kept))
            finally:
                run.close()
        except BaseException as failure:  # handed to the consumer, raised there
            error = failure
        finally:
            if ready:  # NOTE: also when the loop failed: the consumer gets every delta made before
                handover(ready)()
            channel.post(_Finished(error), wait=False)

    owner = current_task_id()
    threading.Thread(target=_thread_context().run, args=(work,), name="agentkv-decode", daemon=True).start()
    kept, finished, ended, raised, error = 0, False, False, False, None
    try:
        while True:
            item = await channel.receive()
            if isinstance(item, _Finished):
                finished, error = True, item.error
                if error is not None:
                    raised = True
                    raise error
                return
            for delta in item.deltas:
                await anyio.lowlevel.checkpoint_if_cancelled()  # NOTE: a cancel lands between a batch's deltas too
                kept, ended = delta.kept, isinstance(delta.event, DecodeOutcome)
                yield delta.event
    finally:
        stop.set()
        with anyio.CancelScope(shield=True):
            while not finished:
                item = await channel.receive()
                if isinstance(item, _Finished):
                    finished, error = True, item.error
            if error is not None and not raised:
                logger.warning("a decode step failed after the stream's consumer had left", exc_info=error)
            if not ended and owner is not None and current_task_id() == owner:
                # NOTE: a failure the consumer sees settles where the loop failed; a stream the
                # consumer left settles where it left (the thread may have run past it)
                keep = steps.kept if raised else kept
                await anyio.to_thread.run_sync(_settle, steps, execute, keep)


def _settle(steps: TokenSteps, execute: Callable[[ModelStep], Any], keep: int) -> None:
    """Run ``steps.settle(keep)``. It runs while an error or a cancellation ends the stream, so
    a failing settle is logged and that first error goes on (the next alignment trims the log)."""
    try:
        for step in steps.settle(keep):
            execute(step)
    except Exception:
        logger.exception("settling the KV log after a decode loop stopped early failed; the first error follows")


def _thread_context() -> contextvars.Context:
    """The caller's context variables (an OpenTelemetry span, ...) for the worker thread, less
    the event loop: sniffio reports none there, as in anyio's own worker threads."""
    context = contextvars.copy_context()
    if sniffio is not None:
        context.run(sniffio.current_async_library_cvar.set, None)
    return context


def current_task_id() -> int | None:
    """The running task's id; None outside one (a generator closed after its event loop):
    ``owner = current_task_id()``."""
    try:
        return anyio.get_current_task().id
    except RuntimeError:
        return None
