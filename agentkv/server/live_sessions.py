"""LiveSessions: the server's KV sessions, matched to stateless requests by shared prefix.

A client of ``/v1/chat/completions`` resends the whole history each turn. The server keeps the
KV sessions of recent requests alive; a request takes the idle one whose token log shares the
longest prefix with its rendered prompt, so only the new tokens are prefilled. A ``pin`` (the
request's ``user`` or an ``X-Session-Id`` header) names a session to use whatever it holds.
Answers the server generated are remembered with their token ids, so a resent history renders
to the very tokens the KV holds (a re-tokenised answer could differ)::

    live = LiveSessions(engine, max_sessions=64)
    history = live.with_token_ids(history)
    async with live.checkout(prompt_ids, pin=None) as kv:
        ...                                   # run on kv
    live.remember(answer_message)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
from cachetools import FIFOCache

from agentkv.chat.messages import Message
from agentkv.engine.base import Engine, KVSession, common_prefix_len
from agentkv.errors import SessionBusy

REMEMBERED_ANSWERS = 4096
"""Generated answers whose token ids are kept for re-rendering resent histories."""


@dataclass
class _Live:
    kv: KVSession
    salt: str = ""
    pin: str | None = None
    busy: bool = False
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

    @asynccontextmanager
    async def checkout(self, prompt_ids: Sequence[int], *, pin: str | None = None,
                       salt: str = "") -> AsyncIterator[KVSession]:
        """The KV session of tenant ``salt`` to run ``prompt_ids`` on, held busy until the block
        exits (a tenant never gets another's session, nor its cached prefixes). ``SessionBusy``
        when the pinned session is running another request."""
        live = await self._take(prompt_ids, pin, salt)
        try:
            yield live.kv
        finally:
            live.busy, live.used_at = False, time.monotonic()
            if not self.reuse:
                with anyio.CancelScope(shield=True):
                    await self._close(live)

    async def _take(self, prompt_ids: Sequence[int], pin: str | None, salt: str) -> _Live:
        async with self._lock:
            if pin is not None:
                pinned = next((live for live in self._live if live.pin == pin and live.salt == salt), None)
                if pinned is not None:
                    if pinned.busy:
                        raise SessionBusy(pin)
                    pinned.busy = True
                    return pinned
            elif self.reuse:
                best = self._best_continued(prompt_ids, salt)
                if best is not None:
                    best.busy = True
                    return best
            await self._make_room()
            live = _Live(await self.engine.open_session(salt=salt), salt=salt, pin=pin, busy=True)
            self._live.append(live)
            return live

    def _best_continued(self, prompt_ids: Sequence[int], salt: str) -> _Live | None:
        """The idle unpinned session sharing the longest prefix with ``prompt_ids``, if that
        prefix is at least half of what it holds: a request continuing its conversation, not one
        that merely starts alike (a shared system prompt comes from the prefix cache instead,
        without trimming another conversation's KV away)."""
        best, best_len = None, 0
        for live in self._live:
            if live.busy or live.pin is not None or live.salt != salt:
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
