"""Responses: ``/v1/responses`` on the Python API. A stored response (``store``, the default) runs
on a stored conversation: ``previous_response_id`` names the response to continue, whose
conversation is still open with its KV — or is resumed from the store and its KV snapshot, after a
restart too — so a turn sends, and prefills, only its new input. ``store=false`` runs like a chat
completion, on the live KV session that shares the longest prefix, and is not kept::

    service = Responses(runs, agents, OpenConversations(Runtime(engine, store)), store, model_id="SmolLM2")
    first = await service.create(ResponseRequest.model_validate({"model": "m", "input": "Hi"}))
    second = await service.create(ResponseRequest.model_validate(
        {"model": "m", "input": "And then?", "previous_response_id": first["id"]}))

Every response carries its conversation's id as ``X-Session-Id`` (so a session-affine proxy can
hash on it) and its own id as ``X-Response-Id`` (so a proxy can learn where a chain that sends no
header lives, from ``previous_response_id``); a request may name the conversation by that header instead of by
``previous_response_id``: it continues the conversation from its newest response, or starts a new
conversation under that id. A response continues only from the newest response of its
conversation (an older one answers 409); a run that did not finish (an error, a client that hung
up, a crash) leaves no response, and its input leaves the window when the conversation next
continues.

Across replicas (one store): a run holds the conversation's lease, and the response is stored
before the lease is given back; a request for a conversation another replica is running waits
for the lease (``Runtime.lease_wait_s``), then continues on the newest snapshot — or, when that
run already went past the response it continues, answers 409 ``response_superseded`` (nothing is
run or rewound).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from contextlib import aclosing, contextmanager
from dataclasses import dataclass
from typing import Any

import anyio

from agentkv.agent import Agent
from agentkv.chat.messages import Message
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.run.conversation import Conversation
from agentkv.errors import ContextOverflowError, ResponseSuperseded, ConversationBusy, ConversationNotFound, UserError
from agentkv.events import RunEvent, RunFinished
from agentkv.memory import ResponseRecord, Store
from agentkv.runtime.persistence import load_window
from agentkv.policies import Truncation
from agentkv.result import RunResult
from agentkv.run.input import checked_input
from agentkv.server.access_log import AccessNote
from agentkv.server.errors import ApiError, as_api_error
from agentkv.server.open_conversations import OpenConversations
from agentkv.server.request_agents import RequestAgents, reserving_answer
from agentkv.server.response_stream import ResponseOutput
from agentkv.server.response_wire import ResponseRequest, new_id, response_object, response_usage
from agentkv.server.runs import Prepared, Runs, kv_namespace, leading_system
from agentkv.server.conversation_ids import SESSION_HEADER, new_conversation_id
from agentkv.server.stream_batches import joined_deltas, ready_batches
from agentkv.server.wire import TokenCounts, cache_break_field

RESPONSE_HEADER = "X-Response-Id"
"""The header every ``/v1/responses`` answer carries its response's id in (streamed ones too)."""

logger = logging.getLogger(__name__)


SHUTTING_DOWN = "the server is shutting down: the response was stopped before its end; send it again"


class _Stopped(Exception):
    """The server's shutdown stopped a streamed run."""


@dataclass
class ResponsePlan:
    """A request read and checked: who asks, the agent, the input, what it continues."""

    request: ResponseRequest
    owner: str
    """The API key's namespace: who may read the response later."""
    salt: str
    """The KV namespace (the owner, with the request's ``cache_salt``)."""
    base: Agent
    """The agent as registered (the runtime knows it by name)."""
    agent: Agent
    """``base`` with this request's sampling and truncation."""
    input: list[Message]
    previous: ResponseRecord | None
    conversation_id: str
    """The conversation's id, sent back as ``X-Session-Id`` (``store=false``: that of the
    previous response's conversation, else the live KV session's)."""
    live_id: str | None = None
    """``store=false``: the live KV session the run takes (``Runs.route``)."""
    pin: str | None = None
    """``store=false``: what keeps the live KV session to this request's conversation (its
    ``X-Session-Id``, else its ``user``)."""
    prepared: Prepared | None = None
    """``store=false``: the history and input, ready for a live KV session."""
    response_id: str = dataclasses.field(default_factory=lambda: new_id("resp"))
    """The id the response gets (known before it runs: a stream's headers carry it)."""

    @property
    def headers(self) -> dict[str, str]:
        """The headers the answer carries: ``X-Session-Id`` and ``X-Response-Id``."""
        return {SESSION_HEADER: self.conversation_id, RESPONSE_HEADER: self.response_id}


class Responses:
    """Serves the Responses API. See the module docstring for a call."""

    def __init__(self, runs: Runs, agents: RequestAgents, conversations: OpenConversations | None,
                 store: Store | None, *, model_id: str) -> None:
        """Without a store (``conversations`` and ``store`` None) only ``store=false`` is served."""
        self.runs = runs
        self.agents = agents
        self.conversations = conversations
        self.store = store
        self.model_id = model_id

    # ---- the request, read --------------------------------------------------------------
    async def plan(self, request: ResponseRequest, *, tenant: str = "",
                   conversation_id: str | None = None) -> ResponsePlan:
        """``request`` checked for ``tenant``: 400 for what cannot run, 404 for an unknown
        ``previous_response_id``, 409 when it is not the newest of its conversation; what the
        input breaks names ``input`` as its ``param``. ``conversation_id``: the request's
        ``X-Session-Id`` (checked against ``previous_response_id``; without that, it names the
        stored conversation to continue, or the new one's id)."""
        salt = kv_namespace(tenant, request.cache_salt)
        with _about_input():
            from_input, messages = leading_system(messages_from_openai(request.input_messages()))
        instructions = "\n\n".join(t for t in (request.instructions, from_input) if t is not None) or None
        base = self.agents.agent(instructions=instructions, tools=request.function_tools(),
                                 tool_choice=request.tool_choice_name(),
                                 parallel_tool_calls=request.parallel_tool_calls is not False,
                                 output=request.output_format(), salt=salt)
        policy = Truncation() if request.truncation == "auto" and base.policy is None else base.policy
        agent = dataclasses.replace(base, generation=request.generation_config(self.agents.defaults),
                                    policy=None if request.truncation == "disabled" else policy)
        agent = reserving_answer(agent, request.max_output_tokens, self.runs.runtime.engine.max_context_len,
                                 param="max_output_tokens")
        previous = None
        if request.store or request.previous_response_id is not None:
            store = self._require_store(request)
            if request.previous_response_id is not None:
                previous = await store.get_response(request.previous_response_id, owner=tenant)
                await self._refuse_superseded(store, previous)
                _check_named(conversation_id, previous)
            elif request.store and conversation_id is not None:
                previous = await self._newest_of(store, conversation_id, tenant)
                if previous is not None:
                    request = request.model_copy(update={"previous_response_id": previous.id})
        history = await self._history(previous)
        if not request.store:
            with _about_input():
                prepared = self.runs.prepare(agent, [*history, *messages], salt=salt)
            pin = conversation_id or request.user
            live_id = self.runs.route(prepared, conversation_id=conversation_id, pin=pin)
            echoed = conversation_id or (previous.conversation_id if previous is not None else live_id)
            return ResponsePlan(request, tenant, salt, base, agent, messages, previous, echoed, live_id, pin,
                                prepared)
        # NOTE: what the run would refuse is refused here, so a stream never starts on it
        self.runs.refuse_if_full()
        assert self.conversations is not None
        if previous is not None and self.conversations.is_running(previous.conversation_id):
            raise ConversationBusy(previous.conversation_id, "another response is being generated in it")
        with _about_input():
            checked_input(agent, history, messages)
            if agent.policy is None:
                self.runs.fitting_prompt(agent, [*history, *messages])
        conversation_id = previous.conversation_id if previous is not None else conversation_id or new_conversation_id()
        return ResponsePlan(request, tenant, salt, base, agent, messages, previous, conversation_id)

    async def _newest_of(self, store: Store, conversation_id: str, tenant: str) -> ResponseRecord | None:
        """The newest response of the stored conversation ``conversation_id`` (None: no such
        conversation, the request starts it); 409 when it exists but holds no response of
        ``tenant``'s to continue."""
        try:
            await store.get_conversation(conversation_id)
        except ConversationNotFound:
            return None
        newest = await store.responses(conversation_id)
        if not newest or newest[0].owner != tenant:
            raise ApiError(409, f"conversation {conversation_id!r} exists and has no response of yours to continue: "
                                f"send another {SESSION_HEADER} (or none, to get a new one)",
                           "conversation_conflict", SESSION_HEADER)
        return newest[0]

    async def _history(self, previous: ResponseRecord | None) -> list[Message]:
        """The window of the previous response's conversation, as that response left it."""
        if previous is None:
            return []
        assert self.store is not None
        window = await load_window(self.store, previous.conversation_id)
        return [e.message for e in window if e.seq is None or e.seq <= previous.last_seq]

    def _require_store(self, request: ResponseRequest) -> Store:
        if self.store is None:
            need = "previous_response_id" if request.previous_response_id else "store=true (the default)"
            raise UserError(f"this server keeps no responses, so {need} cannot be served: send store=false "
                            "with the whole conversation as input, or start the server with a store (--db)")
        return self.store

    async def _refuse_superseded(self, store: Store, previous: ResponseRecord) -> None:
        newest = (await store.responses(previous.conversation_id))[0]
        if newest.id != previous.id:
            raise ResponseSuperseded(previous.conversation_id, newest.id)

    # ---- running ------------------------------------------------------------------------
    async def stream(self, plan: ResponsePlan, *, note: AccessNote | None = None,
                     stop: anyio.Event | None = None) -> AsyncIterator[dict[str, Any]]:
        """The stream events of the response: ``response.created`` once the input is accepted and
        the run has begun, ``response.completed`` (or ``.incomplete``) last, once it is stored.
        Once ``stop`` is set (the server is shutting down) the run is stopped at its next event and
        the stream ends with ``response.failed`` — or yields nothing if that was its first: every
        stream that says anything says ``response.created`` first. Nothing is stored (as for any
        unfinished run). What refuses the run (the conversation's lease another replica holds, a
        full server) is raised before any event."""
        response_id, created = plan.response_id, int(time.time())
        note = note or AccessNote()
        note.update(id=response_id)
        output = ResponseOutput()
        body: dict[str, Any] | None = None
        saved = False
        async with self.runs.admitted():
            with self.runs.waiting_for_kv():
                session = await self._conversation(plan) if plan.request.store else None
            note.update(conversation=plan.conversation_id)
            try:
                events = self._stored_events(plan, session) if session else self._unstored_events(plan)
                # NOTE: the deltas ready at once (a decode run's) go out as one delta event (stream_batches.py)
                async with aclosing(events) as run, aclosing(ready_batches(run)) as batches:
                    async for batch in batches:
                        if stop is not None and stop.is_set():
                            raise _Stopped
                        if output.sequence == 0:  # NOTE: the input was accepted: the response exists now
                            pending = response_object(plan.request, response_id, self.model_id, created, [],
                                                      status="in_progress")
                            yield output.event("response.created", response=pending)
                            yield output.event("response.in_progress", response=pending)
                        for event in joined_deltas(batch):
                            if isinstance(event, RunFinished):
                                body = self._body(plan, response_id, created, output, event.result)
                                if session is not None:  # NOTE: under the run's lease: no other replica between
                                    assert self.store is not None
                                    await self.store.save_response(response_id, session.id, body, owner=plan.owner,
                                                                   fence=session.lease_token)
                                    saved = True
                            for item in output.feed(event):
                                yield item
                assert body is not None
            except BaseException as error:
                if session is not None and plan.previous is None and not saved:  # no response refers to it
                    with anyio.CancelScope(shield=True):
                        await self._drop(session.id)
                if not isinstance(error, _Stopped):
                    raise
        if body is None:  # stopped
            if output.sequence == 0:  # NOTE: before its first event: no response was announced, none fails
                return
            failed = response_object(plan.request, response_id, self.model_id, created, [], status="failed",
                                     error={"code": "server_error", "message": SHUTTING_DOWN})
            yield output.event("response.failed", response=failed)
            return
        note.update(cached_tokens=body["usage"]["input_tokens_details"]["cached_tokens"],
                    kv_from=plan.prepared.restored_from if plan.prepared is not None else None)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        yield output.event(kind, response=body)

    async def create(self, plan: ResponsePlan, *, note: AccessNote | None = None) -> dict[str, Any]:
        """The ``response`` object, once the run is over (and the response stored)."""
        body: dict[str, Any] = {}
        async for event in self.stream(plan, note=note):
            if event["type"] in ("response.completed", "response.incomplete"):
                body = event["response"]
        return body

    async def _conversation(self, plan: ResponsePlan) -> Conversation:
        """The stored conversation the response continues (open, or resumed), or a new one."""
        assert self.conversations is not None
        if plan.previous is None:
            session = await self.conversations.new(plan.base, salt=plan.salt, conversation_id=plan.conversation_id)
        else:
            session = await self.conversations.get(plan.previous.conversation_id, plan.base, salt=plan.salt)
        session.agent = plan.agent
        return session

    async def _stored_events(self, plan: ResponsePlan, session: Conversation) -> AsyncGenerator[RunEvent, None]:
        """The run on the stored conversation, from the previous response's last message (what a
        run that never finished left after it leaves the window first)."""
        assert self.conversations is not None
        continue_from = None if plan.previous is None else plan.previous.last_seq
        async with aclosing(self.conversations.runtime.run_stream(session, plan.input,
                                                                  continue_from=continue_from)) as run:
            async for event in run:
                yield event

    async def _unstored_events(self, plan: ResponsePlan) -> AsyncGenerator[RunEvent, None]:
        """``store=false``: the previous response's history (if any) and the input, run on the
        live KV session sharing the longest prefix (as a chat completion)."""
        assert plan.prepared is not None and plan.live_id is not None
        async with aclosing(self.runs.on_live_session(plan.prepared, plan.live_id, plan.pin)) as run:
            async for event in run:
                yield event

    async def _drop(self, conversation_id: str) -> None:
        """Delete the conversation a failed first request made (no response refers to it); never
        raises over the error that failed the request: a conversation still leased (the run's
        release failed) or a store error leaves it stored, with a warning (``conversations prune``)."""
        assert self.conversations is not None and self.store is not None
        await self.conversations.close(conversation_id)
        try:
            await self.store.delete_conversation(conversation_id)
        except Exception as error:
            logger.warning("could not delete conversation %s that a failed request made (%s); it stays stored",
                           conversation_id, error)

    def _body(self, plan: ResponsePlan, response_id: str, created: int, output: ResponseOutput,
              result: RunResult) -> dict[str, Any]:
        cut = result.finish_reason in ("length", "tool_call_cut")
        body = response_object(plan.request, response_id, self.model_id, created,
                               output.items(result, len(plan.input)),
                               status="incomplete" if cut else "completed",
                               incomplete_reason="max_output_tokens" if cut else None,
                               usage=response_usage(TokenCounts.of(result.call_metrics)))
        return {**body, "agentkv": cache_break_field(result.cache_breaks)}

    # ---- stored responses ---------------------------------------------------------------
    async def get(self, response_id: str, *, tenant: str = "") -> dict[str, Any]:
        """The stored ``response`` object (``ResponseNotFound``: 404)."""
        store = self._store_or_404(response_id)
        return (await store.get_response(response_id, owner=tenant)).body

    async def delete(self, response_id: str, *, tenant: str = "") -> dict[str, Any]:
        """Delete a stored response; with its conversation's last response the conversation goes
        too (its KV is released). 409 while a run continues the conversation."""
        store = self._store_or_404(response_id)
        record = await store.get_response(response_id, owner=tenant)
        assert self.conversations is not None
        if self.conversations.is_running(record.conversation_id):
            raise ConversationBusy(record.conversation_id, "a response is being generated in it")
        if await store.delete_response(response_id, owner=tenant):
            await self.conversations.close(record.conversation_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    def _store_or_404(self, response_id: str) -> Store:
        if self.store is None:
            raise ApiError(404, f"no stored response {response_id!r}: this server keeps none (start it with --db)",
                           "response_not_found")
        return self.store

    async def aclose(self) -> None:
        if self.conversations is not None:
            await self.conversations.aclose()


def _check_named(conversation_id: str | None, previous: ResponseRecord) -> None:
    """400 when the request's ``X-Session-Id`` names another conversation than its
    ``previous_response_id`` continues."""
    if conversation_id is not None and conversation_id != previous.conversation_id:
        raise ApiError(400, f"{SESSION_HEADER} {conversation_id!r} names another conversation than "
                            f"previous_response_id {previous.id!r} continues ({previous.conversation_id!r}): send "
                            "that one, or leave the header out", "conversation_mismatch", SESSION_HEADER)


@contextmanager
def _about_input() -> Iterator[None]:
    """What the block refuses (bad, misplaced or oversized input) names ``input`` as its param."""
    try:
        yield
    except (ContextOverflowError, UserError, ValueError) as error:
        api = as_api_error(error)
        raise ApiError(api.status, api.message, api.code, "input") from error
