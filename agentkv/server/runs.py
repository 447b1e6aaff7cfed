"""Runs: how the server admits a request and runs a history it was sent whole — split into what
the KV may already hold and the new messages, checked against the context, then run on the live KV
session that shares the longest prefix with it.

::

    runs = Runs(Runtime(engine), LiveSessions(engine), max_running=64)
    prepared = runs.prepare(agent, messages, salt="")
    conversation_id = runs.route(prepared, conversation_id=None)      # the X-Session-Id the answer carries
    async with runs.admitted():
        async for event in runs.on_live_session(prepared, conversation_id):
            ...
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, aclosing, asynccontextmanager, contextmanager
from dataclasses import dataclass

from agentkv.agent import Agent
from agentkv.chat.messages import Message
from agentkv.engine.base import KVSession, common_prefix_len
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.memory.prompt_kv import find_answer_tokens, keep_answer_tokens, load_prompt_kv, save_prompt_kv
from agentkv.memory.unstored_kv import LogOfSpan, read_unstored_kv
from agentkv.run.conversation import Conversation, WindowEntry, render_for
from agentkv.errors import ContextOverflowError, UserError
from agentkv.events import RunEvent, RunFinished
from agentkv.run.input import checked_input
from agentkv.runtime.runtime import Runtime
from agentkv.server.errors import RETRY_LATER, ApiError
from agentkv.server.kv_saves import KVSaves
from agentkv.server.live_sessions import LiveSessions, answer_digest

logger = logging.getLogger("agentkv.server")


@dataclass
class Prepared:
    """A history read into what a run needs."""

    salt: str
    """The tenant: cached prefixes and live sessions are shared within it only."""
    agent: Agent
    history: list[Message]
    """What the KV may already hold: up to the last assistant turn."""
    tail: list[Message]
    """The new messages the model answers."""
    prompt_ids: tuple[int, ...]
    restored_from: dict[str, int] = dataclasses.field(default_factory=dict)
    """Tokens of KV the run restored from the store, by tier ("host", "disk", "s3"): what the
    access log says (``kv_from=``)."""


def kv_namespace(tenant: str, cache_salt: str | None) -> str:
    """The salt a request's KV is shared under: its API key's tenant, narrowed by its
    ``cache_salt`` (as vLLM's) when it sends one."""
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


def leading_system(messages: list[Message]) -> tuple[str | None, list[Message]]:
    """The system (developer) messages that open ``messages``, joined as instructions (None if
    none), and the rest; ``UserError`` for a system message inside the conversation."""
    system = []
    rest = list(messages)
    while rest and rest[0].role == "system":
        system.append(rest.pop(0).content)
    if any(m.role == "system" for m in rest):
        raise UserError("system (or developer) messages must come first, before the conversation")
    return ("\n\n".join(system) if system else None), rest


class Runs:
    """Admission (at most ``max_running`` requests at once, more get 429) and runs on live KV."""

    def __init__(self, runtime: Runtime, live: LiveSessions, *, max_running: int = 64,
                 store: Store | None = None) -> None:
        """``store``: where the KV of conversations sent whole is kept between turns, for any
        replica to restore (``memory/prompt_kv.py``); None keeps it in this process only."""
        self.runtime = runtime
        self.live = live
        self.max_running = max_running
        self.store = store
        self.saves = KVSaves()
        """The store writes of finished turns, off the response path (``aclose`` waits for them)."""
        self.running = 0
        """Requests admitted (at most ``max_running``), those waiting for their KV session included."""
        self.waiting = 0
        """Admitted requests still waiting for their KV session (``waiting_for_kv``)."""

    def refuse_if_full(self) -> None:
        """``ApiError`` 429 (with ``Retry-After``) when ``max_running`` requests are running (checked
        again on admission)."""
        if self.running >= self.max_running:
            raise ApiError(429, f"the server is busy: {self.running} requests are running; retry later",
                           "rate_limit_exceeded", headers=RETRY_LATER)

    @asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """Count the request as running for the block; ``ApiError`` 429 when the server is full."""
        self.refuse_if_full()
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1

    @contextmanager
    def waiting_for_kv(self) -> Iterator[None]:
        """Count an admitted request as waiting while the block gets its KV session::

            with runs.waiting_for_kv():
                session = await conversations.get(conversation_id, agent)
        """
        self.waiting += 1
        try:
            yield
        finally:
            self.waiting -= 1

    def prepare(self, agent: Agent, messages: Sequence[Message], *, salt: str) -> Prepared:
        """``messages`` (no system turn: the agent has it) split at the last assistant turn and
        rendered; ``UserError`` (400) without new messages, ``ContextOverflowError`` (413) over
        the context — before anything runs."""
        last_answer = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        history, tail = list(messages[: last_answer + 1]), list(messages[last_answer + 1:])
        if not tail:
            raise UserError("the last message must be a user message or tool results for the model to answer")
        self.refuse_if_full()
        checked_input(agent, history, tail)  # what the run would refuse is a 400 before a stream begins
        history = self.live.with_token_ids(history)
        return Prepared(salt, agent, history, tail, self.fitting_prompt(agent, [*history, *tail]))

    def fitting_prompt(self, agent: Agent, messages: Sequence[Message]) -> tuple[int, ...]:
        """The prompt ``agent`` renders over ``messages``; ``ContextOverflowError`` (413) when it
        leaves no room for an answer in the model's context."""
        prompt = render_for(self.runtime.renderer, agent, messages).token_ids
        limit = agent.prompt_budget(self.runtime.engine.max_context_len)
        if len(prompt) > limit:
            raise ContextOverflowError(
                f"the messages need {len(prompt)} tokens, over the {limit} this model's context leaves "
                f"({agent.min_response_len} kept for the answer); send a shorter history, or start the "
                f"server with a context-window policy (agentkv serve --policy truncation|sliding|summarize)",
                prompt_tokens=len(prompt), limit=limit)
        return tuple(prompt)

    def route(self, prepared: Prepared, *, conversation_id: str | None, pin: str | None = None) -> str:
        """The id of the live KV session ``prepared`` will run on: ``conversation_id`` (the request's
        ``X-Session-Id``) if given, else the session of ``pin`` (its ``user``), else the one
        sharing the longest prefix with it, else a new id (``LiveSessions.route``)."""
        return self.live.route(prepared.prompt_ids, conversation_id=conversation_id, pin=pin, salt=prepared.salt)

    async def on_live_session(self, prepared: Prepared, conversation_id: str,
                              pin: str | None = None) -> AsyncGenerator[RunEvent, None]:
        """The run's events on the live KV session ``conversation_id`` (from ``route``; ``pin``: the
        request's ``X-Session-Id``, else its ``user``), held for the run; the answers it generates
        are remembered."""
        async with AsyncExitStack() as held:
            with self.waiting_for_kv():
                kv = await held.enter_async_context(self.live.checkout(conversation_id=conversation_id, pin=pin,
                                                                       salt=prepared.salt))
            space = self._kv_space(prepared.salt)
            if space is not None and self._store_may_hold_more(kv, space, prepared.prompt_ids):
                prepared = await self._with_kept_answers(prepared)
                prepared.restored_from.update(await self._restore_by_prompt(kv, space, prepared.prompt_ids))
            conversation = Conversation(f"api-{uuid.uuid4().hex[:12]}", prepared.agent, self.runtime.engine, kv,
                                        self.runtime.renderer, window=[WindowEntry(m) for m in prepared.history])
            conversation.call_checks.self_check = self.runtime.self_check
            answers: list[Message] = []
            async with aclosing(self.runtime.run_stream(conversation, prepared.tail)) as run:
                async for event in run:
                    if isinstance(event, RunFinished):
                        answers = [m for m in event.result.new_messages if m.role == "assistant"]
                        for message in answers:
                            self.live.remember(message)
                    yield event
            unstored = await self._read_unstored(kv, space) if space is not None and answers else None
        if unstored is not None:  # NOTE: the session is free again: the write runs after the answer went
            assert space is not None
            await self.saves.start(self._keep(space, *unstored, answers), what="a chat conversation's KV")

    async def aclose(self) -> None:
        """Wait (bounded) for the KV saves still running: ``await runs.aclose()`` before the store closes."""
        await self.saves.aclose()

    def _kv_space(self, salt: str) -> KVNamespace | None:
        """The namespace a tenant's KV blocks are kept in (None without a store)."""
        if self.store is None:
            return None
        return self.runtime.engine.kv_namespace(salt=salt, block_size=self.store.block_size)

    @staticmethod
    def _store_may_hold_more(kv: KVSession, space: KVNamespace, prompt: Sequence[int]) -> bool:
        """Whether the store could give more of ``prompt`` than ``kv`` holds: its whole blocks reach
        past what the session shares with it (a new session; a live one left behind while other
        replicas ran the conversation, as requests without ``X-Session-Id`` go wherever)."""
        whole = len(prompt) // space.block_size * space.block_size
        return common_prefix_len(kv.tokens, prompt) < whole

    async def _restore_by_prompt(self, kv: KVSession, space: KVNamespace, prompt: Sequence[int]) -> dict[str, int]:
        """Restore into ``kv`` the stored blocks of ``prompt``'s longest prefix when they hold more
        of it than ``kv`` (another replica ran this conversation); the tokens each tier gave. A
        failure only costs the prefill."""
        assert self.store is not None
        try:
            found = await load_prompt_kv(self.store, space, prompt, better_than=common_prefix_len(kv.tokens, prompt))
            if found is not None:
                await kv.restore(found.snapshot)
                return found.restored_from
        except Exception as error:  # NOTE: a store that cannot be read costs a prefill, never the turn
            logger.warning("could not restore a conversation's KV from the store (%s: %s); prefilling it",
                           type(error).__name__, error)
        return {}

    async def _with_kept_answers(self, prepared: Prepared) -> Prepared:
        """``prepared`` with the token ids another replica generated for its answers put back (and
        its prompt rendered again) when the store kept them: a resent answer then renders to the
        tokens its stored KV holds."""
        assert self.store is not None
        missing: dict[str, list[int]] = {}
        for i, m in enumerate(prepared.history):  # NOTE: equal answers share a key: each gets the ids
            if m.role == "assistant" and m.token_ids is None:
                missing.setdefault(answer_digest(m), []).append(i)
        try:
            kept = await find_answer_tokens(self.store, list(missing))
        except Exception as error:  # NOTE: costs a longer prefill at most
            logger.warning("could not read kept answers from the store (%s: %s)", type(error).__name__, error)
            return prepared
        if not kept:
            return prepared
        history = list(prepared.history)
        for key, ids in kept.items():
            for i in missing[key]:
                history[i] = history[i].model_copy(update={"token_ids": ids})
        return dataclasses.replace(prepared, history=history,
                                   prompt_ids=self.fitting_prompt(prepared.agent, [*history, *prepared.tail]))

    async def _read_unstored(self, kv: KVSession, space: KVNamespace) -> tuple[KVSnapshot, LogOfSpan | None] | None:
        """The KV of ``kv`` past the blocks the store holds, and its log (read while the run still
        holds the session); None when it cannot be read (logged: the next turn elsewhere prefills)."""
        assert self.store is not None
        try:
            return await read_unstored_kv(self.store.blocks, kv, space, len(kv.tokens))
        except Exception as error:  # NOTE: never fails the turn
            logger.warning("could not read a conversation's KV to keep it (%s: %s)", type(error).__name__, error)
            return None

    async def _keep(self, space: KVNamespace, span: KVSnapshot, log: LogOfSpan | None,
                    answers: Sequence[Message]) -> None:
        """Keep the KV's full blocks in the store, findable by their tokens from any replica, and
        the token ids of the answers that produced it (in the background: ``KVSaves``)."""
        assert self.store is not None
        await keep_answer_tokens(self.store, {answer_digest(m): m.token_ids for m in answers
                                              if m.token_ids is not None})
        await save_prompt_kv(self.store, space, span, log)
