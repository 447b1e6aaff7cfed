"""Clients that hang up before their answer: the request's work stops there, and what it took — its
place among the running requests, a conversation's lease, a conversation it had just made — is
released as the work unwinds. A request waiting for a conversation another replica runs is not
waited for on behalf of nobody.

::

    answer = await unless_hung_up(request.receive, responses.create(plan))
    if answer is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)      # for the access log: nobody reads it
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.types import Receive

T = TypeVar("T")

CLIENT_CLOSED_REQUEST = 499
"""The status the access log shows for a request whose client hung up before its answer (nginx's)."""


async def wait_for_hang_up(receive: Receive) -> None:
    """Return once the client has disconnected; call it after the request's body was read (the
    server then has nothing but ``http.disconnect`` to tell)::

        await wait_for_hang_up(request.receive)
    """
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(receive: Receive, work: Awaitable[T]) -> T | None:
    """What ``work`` returns (or raises), or None once the client hung up first: ``work`` is then
    cancelled, and releases what it holds as it unwinds::

        body = await unless_hung_up(request.receive, chat.complete(...))
    """
    done: list[T] = []
    failure: BaseException | None = None
    async with anyio.create_task_group() as tasks:

        async def watch() -> None:
            await wait_for_hang_up(receive)
            tasks.cancel_scope.cancel()

        tasks.start_soon(watch)
        try:
            done.append(await work)
        except Exception as error:  # NOTE: raised below, not from inside the task group (no group)
            failure = error
        finally:
            tasks.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return done[0] if done else None
