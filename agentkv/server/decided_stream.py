"""DecidedStream: a server-sent event stream whose status line waits for its first event, so a
request refused before it runs is an ordinary error answer, not a 200 whose body is an error.

What refuses a streamed request only once its run begins — the conversation's lease held by another
replica (409 with ``Retry-After``), a named live session another request is running, a full
server (429) — comes before the stream's first event; until that event no byte is sent, so the
answer is the error's status and error object, without the headers a run's answer carries
(``X-Session-Id``, ``X-Response-Id``: a session-affine proxy must not learn a conversation's
replica from a request that ran nothing). A client that hangs up meanwhile stops the run there;
a server that begins to shut down meanwhile (a run still waiting for its lease, or in its prefill)
cancels it and answers ``empty`` (503, ``Retry-After``).
Once the first event is out, an error travels as a last event. The price: the status line of a
run that does begin waits for its first event (a lease wait, then the prompt's prefill)::

    stream = DecidedStream(chat_events(), headers={SESSION_HEADER: conversation_id}, stop=stop, grace_s=5.0,
                           error_event=lambda api: {"data": json.dumps(error_body(api.status, api.message))},
                           empty=ApiError(503, "the server is shutting down: send the request again"))
    return stream          # a route's answer (a Starlette Response)
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Union

import anyio
from anyio.abc import ObjectReceiveStream, ObjectSendStream
from sse_starlette.sse import EventSourceResponse
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from agentkv.server.errors import ApiError, as_api_error, error_answer
from agentkv.server.hang_ups import wait_for_hang_up

logger = logging.getLogger(__name__)

Event = dict[str, str]
"""One server-sent event as sse-starlette takes it (``data``, optionally ``event``)."""


class _End:
    """The events ended."""


class _Stopped:
    """The server began to shut down before the first event."""


_Item = Union[Event, Exception, _End]
"""What the run's task hands the answer: an event, the error that ended the events, or their end."""

PING_S = 15.0
"""Seconds between keep-alive comments on an open stream (proxies cut idle connections)."""
CLEANUP_S = 30.0
"""Seconds the events get to close (their run releasing what it holds) once the answer is over."""


class DecidedStream(Response):
    """An answer (a Starlette ``Response``): the events of ``events`` as server-sent events with ``headers``, once the
    first is there; the error answer (``error_answer``) if ``events`` fails before it, ``empty``'s
    if it ends without one; nothing if the client hangs up first."""

    def __init__(self, events: AsyncGenerator[Event, None], *, headers: Mapping[str, str], stop: anyio.Event,
                 error_event: Callable[[ApiError], Event], empty: ApiError, grace_s: float) -> None:
        """``stop``: set when the server shuts down while the stream is open (``events`` then end
        themselves within ``grace_s`` seconds, or are cut); ``error_event``: the last event an
        error after the first event becomes."""
        super().__init__()
        self.events = events
        self.run_headers = dict(headers)
        """What the answer carries once its first event is there (never on an error answer)."""
        self.stop = stop
        self.error_event = error_event
        self.empty = empty
        self.grace_s = grace_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # NOTE: the events are iterated in one task of their own from start to end (their run holds
        # cancel scopes: a lease keeper's task group must be left in the task that entered it)
        sending, received = anyio.create_memory_object_stream[_Item](0)
        failure: BaseException | None = None
        with received:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(self._produce, sending)
                try:
                    first = await _first_unless_hung_up_or_stopped(received, receive)
                    if isinstance(first, _Stopped):  # no byte is out: the run is cancelled, nothing answered it
                        self.stop.set()
                        await error_answer(self.empty)(scope, receive, send)
                    elif first is not None:
                        await self._answer(first, received)(scope, receive, send)
                except Exception as error:  # NOTE: raised below, not from inside the task group (no group)
                    failure = error
                finally:
                    tasks.cancel_scope.cancel()  # the answer is over (or the client left): the run ends
        if failure is not None:
            raise failure
        if self.background is not None:
            await self.background()

    def _answer(self, first: _Item, rest: ObjectReceiveStream[_Item]) -> Response:
        """The answer the first item decides: an error answer, or the stream of events."""
        if isinstance(first, _End):
            return error_answer(self.empty)
        if isinstance(first, Exception):
            return error_answer(as_api_error(first))
        return EventSourceResponse(self._stream(first, rest), headers=self.run_headers, ping=PING_S,
                                   shutdown_event=self.stop, shutdown_grace_period=self.grace_s)

    async def _stream(self, first: Event, rest: ObjectReceiveStream[_Item]) -> AsyncIterator[Event]:
        yield first
        async for item in rest:
            if isinstance(item, _End):
                return
            if isinstance(item, Exception):  # after the status line: the error travels as an event
                yield self.error_event(as_api_error(item))
                return
            yield item

    async def _produce(self, sending: ObjectSendStream[_Item]) -> None:
        """Iterate the events (in this task only), handing each on; then an error or the end."""
        async with sending:
            try:
                async for event in self.events:
                    await sending.send(event)
                await sending.send(_End())
            except Exception as error:
                await sending.send(error)
            finally:
                with anyio.move_on_after(CLEANUP_S, shield=True) as cleanup:
                    try:
                        await self.events.aclose()
                    except Exception:  # NOTE: logged, not raised: the answer's own outcome stands
                        logger.exception("a stream's events failed as they closed")
                if cleanup.cancel_called:
                    logger.warning("a stream's run took over %.0f s to close; it was cut", CLEANUP_S)


async def _first_unless_hung_up_or_stopped(received: ObjectReceiveStream[_Item],
                                           receive: Receive) -> _Item | _Stopped | None:
    """The first item; None once the client has hung up (``http.disconnect``) before it; ``_Stopped``
    once the server has begun to shut down before it (a run still waiting for its lease or in its
    prefill is then cancelled, and the request answered 503 with ``Retry-After``)."""
    first: list[_Item | _Stopped] = []
    async with anyio.create_task_group() as tasks:

        async def take() -> None:
            try:
                first.append(await received.receive())
            except anyio.EndOfStream:  # the run's task was cancelled: nothing will come
                first.append(_End())
            tasks.cancel_scope.cancel()

        async def watch_shutdown() -> None:
            # NOTE: sse-starlette's own shutdown watch (uvicorn's exit, however it is signalled), the
            # one an open stream's ``shutdown_event`` is set by; a stream not yet open has no other
            await EventSourceResponse._listen_for_exit_signal()
            first.append(_Stopped())
            tasks.cancel_scope.cancel()

        tasks.start_soon(take)
        tasks.start_soon(watch_shutdown)
        await wait_for_hang_up(receive)
        tasks.cancel_scope.cancel()
    return first[0] if first else None
