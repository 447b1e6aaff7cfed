"""OpenConversations: the stored conversations the Responses API keeps open between requests, so
a response chained by ``previous_response_id`` continues on KV that is still alive; at most
``max_open`` (the idle one used longest ago is closed: its history and snapshot stay stored, and
the next response resumes it from them).

::

    conversations = OpenConversations(Runtime(engine, store), max_open=64)
    session = await conversations.new(agent, salt="")
    session = await conversations.get(conversation_id, agent, salt="")   # open, or resumed
"""

from __future__ import annotations

from collections import OrderedDict

import anyio

from agentkv.agent import Agent
from agentkv.run.conversation import Conversation
from agentkv.runtime.runtime import Runtime


UNWIND_S = 5.0
"""Seconds the shutdown waits for cancelled runs to save their snapshots before closing their KV."""


class OpenConversations:
    """Stored conversations with live KV, least recently used closed first."""

    def __init__(self, runtime: Runtime, *, max_open: int = 64) -> None:
        """``runtime`` has the store the conversations live in."""
        self.runtime = runtime
        self.max_open = max_open
        self._open: OrderedDict[str, Conversation] = OrderedDict()
        self._opening: dict[str, anyio.Lock] = {}
        """One lock per conversation being resumed: requests that ask for it meanwhile wait and
        get the same conversation (two would each run it: its run guard is per conversation)."""

    async def new(self, agent: Agent, *, salt: str, conversation_id: str | None = None) -> Conversation:
        """A new stored conversation of tenant ``salt`` (with id ``conversation_id``, else a new one)."""
        await self._make_room()
        session = await self.runtime.open_conversation(agent, salt=salt, conversation_id=conversation_id)
        self._open[session.id] = session
        return session

    async def get(self, conversation_id: str, agent: Agent, *, salt: str) -> Conversation:
        """The open conversation, or the stored one resumed (its KV from the newest snapshot)."""
        session = self._open.get(conversation_id)
        if session is None:
            lock = self._opening.setdefault(conversation_id, anyio.Lock())
            try:
                async with lock:
                    session = self._open.get(conversation_id)  # NOTE: opened while this request waited
                    if session is None:
                        await self._make_room()
                        session = await self.runtime.resume(conversation_id, agent, salt=salt)
                        self._open[conversation_id] = session
            finally:
                if not lock.statistics().tasks_waiting and self._opening.get(conversation_id) is lock:
                    del self._opening[conversation_id]
        self._open.move_to_end(conversation_id)
        return session

    def is_running(self, conversation_id: str) -> bool:
        """True while a run holds the conversation in this process."""
        session = self._open.get(conversation_id)
        return session is not None and session.running

    async def close(self, conversation_id: str, *, snapshot: bool = False) -> None:
        """Release the conversation's KV (what is stored stays); ``snapshot=True`` first saves it
        unless a stored snapshot holds it already (its turn-end snapshot normally does)."""
        session = self._open.pop(conversation_id, None)
        if session is not None:
            await self.runtime.close_conversation(session, snapshot=snapshot)

    async def _make_room(self) -> None:
        while len(self._open) >= self.max_open:
            idle = next((sid for sid, session in self._open.items() if not session.running), None)
            if idle is None:
                return  # every one is running: the request limit bounds this
            await self.close(idle, snapshot=True)  # NOTE: idle, so no run saves it meanwhile

    async def aclose(self) -> None:
        """Close every conversation, each snapshotted first unless its snapshot is stored already
        (the server's shutdown: another replica resumes it from there). Runs the shutdown cancelled
        get ``UNWIND_S`` to end (each saves its own snapshot as it ends) before their KV is closed."""
        with anyio.move_on_after(UNWIND_S):
            while any(session.running for session in self._open.values()):
                await anyio.sleep(0.05)
        for conversation_id in list(self._open):
            session = self._open.pop(conversation_id)
            await self.runtime.close_conversation(session, snapshot=True)

    def __len__(self) -> int:
        return len(self._open)

    def tokens_of(self, conversation_id: str) -> int | None:
        """Tokens of KV the open conversation ``conversation_id`` holds (None: not open here)::

            conversations.tokens_of(conversation_id)
        """
        session = self._open.get(conversation_id)
        return None if session is None else len(session.kv.tokens)
