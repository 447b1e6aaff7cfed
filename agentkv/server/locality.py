"""Locality: where a conversation's KV is — live in this server, in a stored snapshot, or nowhere —
for ``GET /v1/conversations/{id}/locality``, so a proxy (or a person) can see whether a conversation
would continue on live KV here, restore it, or prefill it again::

    locality = Locality(live, conversations, store, fingerprint=engine.fingerprint)
    await locality.of("sess_3f2a…", tenant="")   # {"conversation_id": …, "locality": "live", "tokens": 812}
"""

from __future__ import annotations

from typing import Any, Literal

from agentkv.errors import ConversationNotFound
from agentkv.memory import Store
from agentkv.server.errors import ApiError
from agentkv.server.live_sessions import LiveSessions
from agentkv.server.open_conversations import OpenConversations

Where = Literal["live", "snapshot", "none"]


class Locality:
    """Answers where a conversation's KV is. See the module docstring for a call."""

    def __init__(self, live: LiveSessions, conversations: OpenConversations | None, store: Store | None, *,
                 fingerprint: str) -> None:
        """``fingerprint``: this engine's, so a snapshot another model made does not count."""
        self.live = live
        self.conversations = conversations
        self.store = store
        self.fingerprint = fingerprint

    async def of(self, conversation_id: str, *, tenant: str) -> dict[str, Any]:
        """``{"conversation_id", "locality", "tokens"}`` for ``tenant``'s conversation: ``live`` (its KV is
        held here: tokens held), ``snapshot`` (stored: the newest usable snapshot's tokens) or
        ``none`` (known, no KV anywhere: 0). ``ApiError`` 404 for a conversation neither this server
        nor its store knows of for ``tenant``."""
        held = self.live.tokens_of(conversation_id, tenant)
        if held is None and self.conversations is not None and await self._owned(conversation_id, tenant):
            held = self.conversations.tokens_of(conversation_id)
        if held is not None:
            return _answer(conversation_id, "live", held)
        if self.store is None or not await self._owned(conversation_id, tenant):
            raise ApiError(404, f"no conversation {conversation_id!r} here{' or in the store' if self.store else ''}: "
                                "send the X-Session-Id a response carried", "conversation_not_found")
        usable = [r for r in await self.store.snapshots(conversation_id) if r.fingerprint == self.fingerprint]
        if usable:
            return _answer(conversation_id, "snapshot", usable[0].num_tokens)
        return _answer(conversation_id, "none", 0)

    async def _owned(self, conversation_id: str, tenant: str) -> bool:
        """Whether the store holds ``conversation_id`` for ``tenant``: a conversation of the Responses
        API is its responses' owner's (one without responses, the server's own: the empty tenant's)."""
        if self.store is None:
            return False
        try:
            await self.store.get_conversation(conversation_id)
        except ConversationNotFound:
            return False
        responses = await self.store.responses(conversation_id)
        return (responses[0].owner if responses else "") == tenant


def _answer(conversation_id: str, where: Where, tokens: int) -> dict[str, Any]:
    return {"conversation_id": conversation_id, "locality": where, "tokens": tokens}
