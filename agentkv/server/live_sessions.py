"""LiveSessions: the server's KV sessions, matched to stateless requests by shared prefix.

A client of ``/v1/chat/completions`` resends the whole history each turn. The server keeps the
KV sessions of recent requests alive; a request takes the idle one whose token log shares the
longest prefix with its rendered prompt, so only the new tokens are prefilled. Every session has
an id (the ``X-Session-Id`` a request named it by, or a new one); a request naming an id takes that
session whatever it holds, and a ``pin`` (the request's ``user``) keeps one session per user.
Answers the server generated are remembered with their token ids, so a resent history renders
to the very tokens the KV holds (a re-tokenised answer could differ)::

    live = LiveSessions(engine, max_sessions=64)
    history = live.with_token_ids(history)
    conversation_id = live.route(prompt_ids, conversation_id=None)    # echoed as X-Session-Id
    async with live.checkout(conversation_id=conversation_id) as kv:
        ...                                   # run on kv
    live.remember(answer_message)
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from cachetools import FIFOCache

from agentkv.chat.messages import Message
from agentkv.engine.base import Engine, KVSession, common_prefix_len
from agentkv.errors import ConversationBusy
from agentkv.server.conversation_ids import new_conversation_id

REMEMBERED_ANSWERS = 4096
"""Generated answers whose token ids are kept for re-rendering resent histories."""
CLAIM_S = 30.0
"""Seconds a session ``route`` chose for a request stays reserved for it (no other request's prefix
match takes it) until the request checks it out."""


@dataclass
class _Live:
    kv: KVSession
    id: str
    salt: str = ""
    pin: str | None = None
    busy: bool = False
    claimed_until: float = 0.0
    used_at: float = field(default_factory=time.monotonic)


class LiveSessions:
    """KV sessions kept alive between requests, at most ``max_sessions`` (idle ones closed LRU)."""

    def __init__(self, engine: Engine, *, max_sessions: int = 64, reuse: bool = True) -> None:
        """``reuse=False`` gives every request a fresh session (a stateless server, to compare)."""
        self.engine = engine
        self.max_sessions = max_sessions
        self.reuse = reuse
        self._live: list[_Live] = []
        # NOTE: FIFO, not LRU: remembering an answer again refreshes it, looking it up does not.
        self._answers: FIFOCache[tuple[object, ...], tuple[int, ...]] = FIFOCache(maxsize=REMEMBERED_ANSWERS)
        self._lock = anyio.Lock()

    def route(self, prompt_ids: Sequence[int], *, conversation_id: str | None, pin: str | None = None,
              salt: str = "") -> str:
        """The id of the session a request will run on, known before it runs (so a streamed answer's
        headers carry it): ``conversation_id`` when the request named one, else the session of ``pin``,
        else the idle session continuing ``prompt_ids`` (reserved for the request for ``CLAIM_S``),
        else a new id. Pass it to ``checkout``."""
        if conversation_id is not None:
            return conversation_id
        if pin is not None:
            pinned = self._named(pin, salt)
            return pinned.id if pinned is not None else new_conversation_id()
        best = self._best_continued(prompt_ids, salt) if self.reuse else None
        if best is None:
            return new_conversation_id()
        best.claimed_until = time.monotonic() + CLAIM_S
        return best.id

    @asynccontextmanager
    async def checkout(self, *, conversation_id: str, pin: str | None = None,
                       salt: str = "") -> AsyncIterator[KVSession]:
        """The KV session ``conversation_id`` (from ``route``) of tenant ``salt`` — a new one under that
        id if there is none — held busy until the block exits (a tenant never gets another's
        session, nor its cached prefixes). ``pin`` (the request's ``X-Session-Id``, else its
        ``user``) keeps the session out of other requests' prefix matching. ``ConversationBusy`` when
        the session a request named (by id or ``pin``) is running another request."""
        live = await self._take(conversation_id, pin, salt)
        try:
            yield live.kv
        finally:
            live.busy, live.used_at = False, time.monotonic()
            if not self.reuse:
                with anyio.CancelScope(shield=True):
                    await self._close(live)

    def _named(self, name: str, salt: str) -> _Live | None:
        """The tenant's session with id (or pin) ``name``."""
        return next((live for live in self._live if live.salt == salt and name in (live.id, live.pin)), None)

    async def _take(self, conversation_id: str, pin: str | None, salt: str) -> _Live:
        async with self._lock:
            named = self._named(conversation_id, salt) or (self._named(pin, salt) if pin is not None else None)
            if named is not None and not named.busy:
                named.busy, named.claimed_until = True, 0.0
                return named
            if named is not None and (named.pin is not None or pin == conversation_id):
                raise ConversationBusy(conversation_id)  # the request named it: another one runs on it
            # NOTE: a session matched by prefix and already taken again (its reservation ran out):
            # the request runs on a new one, with an id of its own
            fresh = conversation_id if named is None else new_conversation_id()
            await self._make_room()
            live = _Live(await self.engine.open_session(salt=salt), fresh, salt=salt, pin=pin, busy=True)
            self._live.append(live)
            return live

    def _best_continued(self, prompt_ids: Sequence[int], salt: str) -> _Live | None:
        """The idle unpinned session sharing the longest prefix with ``prompt_ids``, if that
        prefix is at least half of what it holds: a request continuing its conversation, not one
        that merely starts alike (a shared system prompt comes from the prefix cache instead,
        without trimming another conversation's KV away)."""
        best, best_len = None, 0
        for live in self._live:
            if live.busy or live.pin is not None or live.salt != salt or live.claimed_until > time.monotonic():
                continue
            shared = common_prefix_len(live.kv.tokens, prompt_ids)
            if shared > best_len and 2 * shared >= len(live.kv.tokens):
                best, best_len = live, shared
        return best

    async def _make_room(self) -> None:
        while len(self._live) >= self.max_sessions:
            idle = [live for live in self._live if not live.busy]
            if not idle:
                return  # every session is running: the request limit bounds this
            await self._close(min(idle, key=lambda live: live.used_at))

    async def _close(self, live: _Live) -> None:
        if live in self._live:
            self._live.remove(live)
        await live.kv.close()

    async def aclose(self) -> None:
        """Close every session."""
        for live in list(self._live):
            await self._close(live)

    def __len__(self) -> int:
        return len(self._live)

    def tokens_of(self, conversation_id: str, salt_prefix: str) -> int | None:
        """Tokens of KV the live session ``conversation_id`` holds, of a tenant whose KV namespace
        starts with ``salt_prefix`` (None: no such session here)::

            live.tokens_of("conv-42", tenant)
        """
        for live in self._live:
            if conversation_id in (live.id, live.pin) and (live.salt == salt_prefix
                                                           or live.salt.startswith(salt_prefix + "/")):
                return len(live.kv.tokens)
        return None

    # ---- answers the server generated ----------------------------------------------------
    def remember(self, message: Message) -> None:
        """Keep an answer's token ids for when its history comes back."""
        if message.token_ids is not None:
            self._answers[_answer_key(message)] = message.token_ids  # the oldest beyond REMEMBERED_ANSWERS go

    def with_token_ids(self, messages: Sequence[Message]) -> list[Message]:
        """``messages`` with the token ids of answers this server generated put back."""
        out = []
        for message in messages:
            ids = self._answers.get(_answer_key(message)) if message.role == "assistant" else None
            out.append(message.model_copy(update={"token_ids": ids}) if ids is not None else message)
        return out


def _answer_key(message: Message) -> tuple[object, ...]:
    calls = tuple((c.id, c.name, repr(sorted(c.arguments.items()))) for c in message.tool_calls)
    return (message.content, calls)


def answer_digest(message: Message) -> str:
    """A stable digest of an answer's content and calls: the key its token ids are kept under in a
    store, for other replicas (``memory/prompt_kv.py``): ``answer_digest(Message.assistant("Hi."))``."""
    return hashlib.blake2b(repr(_answer_key(message)).encode(), digest_size=32).hexdigest()
