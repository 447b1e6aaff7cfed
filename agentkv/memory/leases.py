"""Conversation leases kept alive by a heartbeat, and the holder ids that let a dead process's lease go.

::

    async with LeaseKeeper(store, conversation_id, holder_id(), ttl_s=30.0) as lease:
        ...                        # renewed every ttl_s / 3 while this block runs
        if lease.lost:
            ...                    # another holder took it over (we stalled past the ttl)
        await store.append_message(conversation_id, message, token_count=n, fence=lease.token)

``LeaseKeeper(..., wait_s=10.0)`` waits up to that long for a lease another live holder has (a
run in another replica), polling with a growing pause, before ``ConversationBusy``.

A holder id is ``host:pid:tag``. ``Store.acquire_lease`` takes over at once a lease whose
holder ran on this host in a process that no longer exists (``holder_is_dead_here``); a holder
on another host, or one whose id does not parse, keeps its lease until it expires.

``lease.token`` is the lease's fencing token: writes that carry it (``fence=``) are refused
with ``LeaseLost`` once the lease has passed to another holder (or was force-released), so a
holder that lost its lease while it stalled cannot write after the next holder did.

A holder whose host crashed cannot be seen dead from another host: its lease is taken over once
it expires, ``DEFAULT_LEASE_TTL_S`` after its last renewal at most (``CROSS_HOST_TAKEOVER_S`` for a
request polling for it), which is shorter than a server request's lease wait. An early takeover of
a holder that only stalled is safe: every write of a run is fenced, so the stalled run loses its
lease and stops, and the history stays the new holder's.

Changes of a conversation's history made outside a run (``Store.rewind``, ``fork_conversation``,
``delete_conversation``) take the lease for their one transaction unless the caller passes its own
token (``fence_or_lease``), so they never interleave with a run's writes.

Expiry times come from the store's clock (``Store(url, clock=FakeClock())`` in a test moves it
by hand: ``agentkv.testing.FakeClock``); the keeper's heartbeat still sleeps in real time.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING

import anyio
from anyio.abc import TaskGroup

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from agentkv.errors import LeaseLost, ConversationBusy, ConversationNotFound, UserError
from agentkv.memory.holders import holder_id, holder_is_dead_here, live_pid_here, parse_holder, pid_is_alive

if TYPE_CHECKING:
    from agentkv.memory.conversation_leases import ConversationLeases

logger = logging.getLogger(__name__)

__all__ = ["CROSS_HOST_TAKEOVER_S", "DEFAULT_LEASE_TTL_S", "DEFAULT_LEASE_WAIT_S", "LEASE_POLL_MAX_S",
           "WRITE_LEASE_WAIT_S", "LeaseKeeper", "acquire_waiting", "fence_or_lease", "holder_id", "holder_is_dead_here",
           "live_pid_here", "parse_holder", "pid_is_alive"]

DEFAULT_LEASE_TTL_S = 6.0
"""Lease length used by ``LeaseKeeper`` (renewed every third of it): a holder whose host crashed
blocks its conversations this long at most. Short, so that a request waiting for such a conversation gets it
within its wait; safe, because a holder that stalls past it only loses its run (its writes are
fenced). Model steps run off the event loop the renewals run on."""
LEASE_POLL_MAX_S = 0.5
"""Longest pause between two tries of a lease another holder has (the first pauses are shorter)."""
CROSS_HOST_TAKEOVER_S = DEFAULT_LEASE_TTL_S + LEASE_POLL_MAX_S
"""How long, at most, a waiting request takes to get a conversation whose holder's host crashed (its
lease expires, then the next poll takes it): a server's lease wait must be longer."""
DEFAULT_LEASE_WAIT_S = 10.0
"""How long a server request waits, by default, for a conversation another replica is running
(``agentkv serve --lease-wait``): longer than ``CROSS_HOST_TAKEOVER_S``, so a request for a
conversation whose replica's host crashed is answered, not refused."""
WRITE_LEASE_WAIT_S = 2.0
"""How long a change of a conversation's history outside a run (``Store.rewind``, ``fork_conversation``,
``delete_conversation``) waits for a live run's lease before ``ConversationBusy`` (``Store(lease_wait_s=)``)."""


async def acquire_waiting(store: ConversationLeases, conversation_id: str, holder: str, ttl_s: float,
                          wait_s: float) -> int:
    """``store.acquire_lease``, tried again while another live holder has the lease, for up to
    ``wait_s`` seconds (0: once); ``ConversationBusy`` when it is still held then. Returns the token::

        token = await acquire_waiting(store, "abc", holder_id(), ttl_s=30, wait_s=10)
    """
    if wait_s < 0:
        raise UserError(f"wait_s must be >= 0 seconds, got {wait_s}")
    if wait_s == 0:
        return await store.acquire_lease(conversation_id, holder, ttl_s)
    retrying = AsyncRetrying(retry=retry_if_exception_type(ConversationBusy), stop=stop_after_delay(wait_s),
                             wait=wait_exponential(multiplier=0.02, max=LEASE_POLL_MAX_S), sleep=anyio.sleep,
                             reraise=True)
    async for attempt in retrying:
        with attempt:
            return await store.acquire_lease(conversation_id, holder, ttl_s)
    raise AssertionError("unreachable: tenacity re-raises the last ConversationBusy")  # pragma: no cover


@asynccontextmanager
async def fence_or_lease(store: ConversationLeases, conversation_id: str, fence: int | None, *,
                         action: str) -> AsyncIterator[int]:
    """The fencing token one change of a conversation's history is written under: the caller's
    ``fence`` (it holds the lease), else the token of a lease taken for the block and released
    after it (waiting ``store.lease_wait_s`` for a live run; then ``ConversationBusy`` naming
    ``action``)::

        async with fence_or_lease(store, "abc", None, action="rewind") as token:
            await store.database.run(...)          # a write checked against token (queries.fenced_row)
    """
    if fence is not None:
        yield fence
        return
    async with AsyncExitStack() as held:
        try:
            # NOTE: a new holder tag: a run of this very process keeps its own lease
            lease = await held.enter_async_context(
                LeaseKeeper(store, conversation_id, holder_id(), wait_s=store.lease_wait_s))
        except ConversationBusy as busy:
            raise ConversationBusy(conversation_id, busy.holder, action=action) from None
        assert lease.token is not None
        yield lease.token


class LeaseKeeper:
    """Holds a conversation's lease for the length of an ``async with`` block, renewing it.

    Entering acquires the lease (``ConversationBusy`` if another live holder has it after ``wait_s``
    seconds of waiting: 0, the default, does not wait); a background
    task renews it every ``ttl_s / 3``; leaving stops the renewals and releases it, even when
    the block is cancelled or raises. Single use.
    """

    def __init__(self, store: ConversationLeases, conversation_id: str, holder: str, *,
                 ttl_s: float = DEFAULT_LEASE_TTL_S, wait_s: float = 0.0) -> None:
        if ttl_s <= 0:
            raise UserError(f"ttl_s must be > 0, got {ttl_s}")
        if wait_s < 0:
            raise UserError(f"wait_s must be >= 0 seconds, got {wait_s}")
        self.wait_s = wait_s
        self.store = store
        self.conversation_id = conversation_id
        self.holder = holder
        self.ttl_s = ttl_s
        self.lost = False
        """True once a renewal found the lease taken by another holder (or the conversation gone)."""
        self.released = False
        """True once ``release`` ran (on leaving the block at the latest)."""
        self.token: int | None = None
        """The lease's fencing token, once entered (pass it as ``fence=`` to the store's writes)."""
        self._entered = False
        self._renewed_at = 0.0  # anyio.current_time() of the last renewal (or of entering)
        # Made on entering: anyio primitives need a running event loop.
        self._renewals: anyio.CancelScope | None = None
        self._lock: anyio.Lock | None = None
        self._tasks: TaskGroup | None = None

    @property
    def held(self) -> bool:
        """Whether this keeper still believes it holds the lease."""
        return self._entered and not (self.lost or self.released)

    async def __aenter__(self) -> LeaseKeeper:
        if self._entered or self.released:
            raise UserError("a LeaseKeeper is single use; create a new one for each block")
        self._entered = True
        self._renewals = anyio.CancelScope()
        self._lock = anyio.Lock()
        try:
            self.token = await acquire_waiting(self.store, self.conversation_id, self.holder, self.ttl_s, self.wait_s)
        except Exception:  # busy, or the acquiring transaction failed: nothing is held
            self.released = True
            raise
        except BaseException as error:  # cancelled: the acquiring transaction may have committed
            with anyio.CancelScope(shield=True):
                await self._release_after_error(error)
            raise
        try:
            self._tasks = anyio.create_task_group()
            await self._tasks.__aenter__()
        except BaseException as error:
            with anyio.CancelScope(shield=True):
                await self._release_after_error(error)
            raise
        self._renewed_at = anyio.current_time()
        self._tasks.start_soon(self._renew_forever)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        # NOTE: the block's own exception is deliberately not passed to the task group: anyio
        # would wrap it in an ExceptionGroup. Only the renewal task is cancelled, never the block.
        assert self._renewals is not None
        self._renewals.cancel()
        try:
            if self._tasks is not None:
                await self._tasks.__aexit__(None, None, None)
        finally:
            with anyio.CancelScope(shield=True):
                await self._release_after_error(exc)

    async def _release_after_error(self, ending: BaseException | None) -> None:
        """``release``, but a failure is logged, never raised: clean-up must not hide the error
        that ended the block (``ending``, reported by whoever catches it: then only a debug line).
        The lease lapses after ``ttl_s``."""
        try:
            await self.release()
        except Exception as error:
            logger.log(logging.DEBUG if ending is not None else logging.WARNING,
                       "could not release the lease of conversation %r (it lapses in %.0f s): %s",
                       self.conversation_id, self.ttl_s, error)

    async def release(self) -> None:
        """Stop renewing and give the lease back (a no-op if another holder has it). Idempotent."""
        if self._renewals is None or self._lock is None:  # never entered: nothing is held
            self.released = True
            return
        self._renewals.cancel()
        async with self._lock:  # a renewal in flight finishes first, so none follows this
            if self.released:
                return
            self.released = True
            await self.store.release_lease(self.conversation_id, self.holder)

    async def _renew_forever(self) -> None:
        assert self._renewals is not None
        with self._renewals:
            while await self._renew_after(self.ttl_s / 3):
                pass

    async def _renew_after(self, delay_s: float) -> bool:
        """Sleep, then renew once; False when renewing must stop (released or lost)."""
        await anyio.sleep(delay_s)
        assert self._lock is not None
        async with self._lock:
            if self.released:
                return False
            assert self.token is not None
            try:
                await self.store.renew_lease(self.conversation_id, self.holder, self.token, self.ttl_s)
                self._note_renewal()
            except LeaseLost as e:
                return self._lose(f"{e.holder} took it over" if e.holder else "it was released (conversations unlock)")
            except ConversationNotFound:
                return self._lose("the conversation was deleted")
            except Exception:  # a database hiccup: the lease is still ours until it expires
                logger.warning("could not renew the lease of conversation %r; retrying in %.1f s",
                               self.conversation_id, delay_s, exc_info=True)
        return True

    def _note_renewal(self) -> None:
        """Warn when this renewal came after the lease had expired: the process stalled (its
        event loop blocked, or the database slow) long enough for another host to take it over."""
        now = anyio.current_time()
        since, self._renewed_at = now - self._renewed_at, now
        if since > self.ttl_s:
            logger.warning("renewed the lease of conversation %r %.1f s after the last renewal, past its ttl of "
                           "%.1f s: this process stalled (a blocked event loop, a slow database) and another host "
                           "could have taken the conversation over meanwhile", self.conversation_id, since, self.ttl_s)

    def _lose(self, why: str) -> bool:
        self.lost = True
        logger.warning("lost the lease of conversation %r: %s (or this process stalled for over %.1f s); "
                       "its writes to the conversation are refused from now on", self.conversation_id, why, self.ttl_s)
        return False
