"""The store's conversation leases: take, renew, give back and read them (a base class of ``Store``).

Each call is one transaction of conditional UPDATEs, atomic across processes; times come from the
store's clock. What holds a lease for a block, renewing it, is ``agentkv.memory.leases``::

    token = await store.acquire_lease(sid, holder_id(), ttl_s=30)
    await store.renew_lease(sid, holder, token, ttl_s=30)
    await store.release_lease(sid, holder)
"""

from __future__ import annotations

import logging

from agentkv.errors import UserError
from agentkv.memory import queries
from agentkv.memory.database import Database
from agentkv.memory.schema import Clock

logger = logging.getLogger(__name__)


class ConversationLeases:
    """Lease methods over ``self.database`` at ``self.clock`` (set by ``Store.__init__``)."""

    database: Database
    clock: Clock
    lease_wait_s: float
    """How long ``rewind``, ``fork_conversation`` and ``delete_conversation`` wait for a run's lease."""

    async def acquire_lease(self, conversation_id: str, holder: str, ttl_s: float = 60) -> int:
        """Take (or renew) the conversation's lease for ``ttl_s`` seconds; returns its fencing token.

        Raises ``ConversationBusy`` while another holder's lease is live; an expired lease is
        taken over, and so at once is one held by a dead process on this host (a
        ``host:pid:tag`` holder, see ``agentkv.memory.leases``). Atomic across processes (conditional
        UPDATEs). ``token = await store.acquire_lease(sid, holder_id(), ttl_s=30)``; pass the
        token as ``fence=`` to writes so none lands once another holder took the lease.
        """
        if ttl_s <= 0:
            raise UserError(f"ttl_s must be > 0, got {ttl_s}")
        taken: tuple[int, str | None] = await self.database.run(
            self.database.write, lambda s: queries.acquire_lease(s, conversation_id, holder, ttl_s, self.clock()))
        token, dead = taken
        if dead is not None:
            logger.warning("took over the lease of conversation %r from %s, whose process is gone",
                           conversation_id, dead)
        return token

    async def renew_lease(self, conversation_id: str, holder: str, fence: int, ttl_s: float = 60) -> None:
        """Extend the lease ``holder`` took with token ``fence`` by ``ttl_s`` seconds;
        ``LeaseLost`` once it was released (``force=True``) or passed to another holder."""
        if ttl_s <= 0:
            raise UserError(f"ttl_s must be > 0, got {ttl_s}")
        await self.database.run(self.database.write,
                                lambda s: queries.renew_lease(s, conversation_id, holder, fence, ttl_s, self.clock()))

    async def release_lease(self, conversation_id: str, holder: str | None = None, *,
                            force: bool = False) -> str | None:
        """Give the lease back: ``holder``'s only, or whoever's with ``force=True``.

        ``await store.release_lease(sid, holder)`` does nothing unless ``holder`` has the lease
        and returns None. ``await store.release_lease(sid, force=True)`` (an operator's unlock)
        returns the holder recorded before, possibly expired, or None; ``ConversationNotFound`` for
        an unknown conversation.
        """
        if force == (holder is not None):
            raise UserError("pass either the holder whose lease to release or force=True, "
                            "not both and not neither")
        if holder is not None:
            await self.database.run(self.database.write, lambda s: queries.release_lease(s, conversation_id, holder))
            return None
        return await self.database.run(self.database.write, lambda s: queries.force_release_lease(s, conversation_id))

    async def lease_holder(self, conversation_id: str) -> str | None:
        """Who holds the conversation's lease now: None if free or expired (read-only).

        ``ConversationNotFound`` for an unknown conversation; ``get_conversation`` shows the raw columns.
        """
        return await self.database.run(self.database.read,
                                       lambda s: queries.lease_holder(s, conversation_id, live_at=self.clock()))
