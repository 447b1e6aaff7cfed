"""Runtime: owns one engine and optionally one store; opens, runs and resumes conversations.

::

    engine = open_engine()                     # PagedEngine on CPU
    runtime = Runtime(engine, store=Store.from_env(), agents=[agent])
    conversation = await runtime.open_conversation(agent)
    result = await runtime.run(conversation, "hello")
    ...                                   # next day, another process:
    conversation = await runtime.resume(conversation_id)

Each agent's system prompt + tool schemas is registered with the engine as a shared prefix.
With a store, every message is committed as it is recorded, a run holds the conversation's lease
(a second process gets ``ConversationBusy``; a heartbeat renews it, and a holder whose process died
on this host is taken over at once), and the KV is snapshotted to a file after each run. A tool
call left without a result by a crash gets an "interrupted" result when the conversation is resumed.
"""

from __future__ import annotations

import dataclasses
import uuid
from functools import partial
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from contextlib import aclosing, asynccontextmanager

import anyio

from agentkv.agent import Agent
from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.render import ChatRenderer
from agentkv.engine.base import Engine, KVSession
from agentkv.errors import ConversationBusy, UserError
from agentkv.events import RunEvent, RunFinished
from agentkv.memory import Store
from agentkv.memory.leases import DEFAULT_LEASE_TTL_S, LeaseKeeper, holder_id
from agentkv.observe import tracing
from agentkv.observe.cache_breaks import locate
from agentkv.observe.self_check import fraction_from
from agentkv.result import RunResult
from agentkv.run.approvals import Decisions, awaiting_approval
from agentkv.run.conversation import Conversation, render_for
from agentkv.run.input import RunInput
from agentkv.run.loop import run_turns
from agentkv.run.past_reasoning import reusable_kv_len
from agentkv.runtime.branches import check_user_message, rewind_window, seed_branch_kv
from agentkv.runtime.persistence import (
    CallLog,
    ResumeReport,
    StoreSink,
    StoreWindowHook,
    catch_up_from_snapshot,
    load_window,
    record_interrupted_calls,
    kv_namespace,
    restore_newest_snapshot,
    save_snapshot,
    save_snapshot_unless_stored,
)
from agentkv.runtime.stored_agent import agent_from_record, agent_settings


class Runtime:
    """One engine, many concurrent conversations; one run at a time per conversation."""

    def __init__(self, engine: Engine, store: Store | None = None, *, agents: Sequence[Agent] = (),
                 holder: str | None = None, lease_ttl_s: float = DEFAULT_LEASE_TTL_S, lease_wait_s: float = 0.0,
                 self_check: float | None = None) -> None:
        """``self_check``: the fraction of model calls whose cached KV is checked against a
        fresh prefill (``agentkv.observe.self_check``; default ``$AGENTKV_SELF_CHECK``, else 0).
        ``lease_wait_s``: how long a run waits for a conversation another process is running
        (e.g. another replica of a server) before ``ConversationBusy``; 0 does not wait."""
        if lease_ttl_s <= 0:
            raise UserError(f"lease_ttl_s must be > 0 seconds, got {lease_ttl_s}")
        if lease_wait_s < 0:
            raise UserError(f"lease_wait_s must be >= 0 seconds, got {lease_wait_s}")
        self.engine = engine
        self.store = store
        if store is not None:  # NOTE: an idle session's offload then writes only what no save wrote
            engine.keep_offloaded_kv_in(store.blocks, block_size=store.block_size)
        self.renderer = ChatRenderer(engine.tokenizer, stop_token_ids=engine.eos_token_ids)
        self.holder = holder or holder_id()
        self.lease_ttl_s = lease_ttl_s
        """How long a run's lease lasts without renewal (renewed every third of it while it runs)."""
        self.lease_wait_s = lease_wait_s
        """How long a run waits for the lease another process holds before ``ConversationBusy``."""
        self.self_check = fraction_from(self_check)
        self._agents: dict[str, Agent] = {}
        self._conversations: dict[str, Conversation] = {}
        for agent in agents:
            self.add_agent(agent)

    def add_agent(self, agent: Agent) -> None:
        """Make ``agent`` known (needed to resume its conversations) and register its shared prefix."""
        self._know(agent, "")

    def _know(self, agent: Agent, salt: str) -> None:
        known = self._agents.get(agent.name)
        if known is not None and known is not agent:
            raise UserError(f"another agent named {agent.name!r} is already registered; use a unique name")
        self._agents[agent.name] = agent
        self.register_agent_prefix(agent, salt=salt)

    def forget_agent(self, name: str) -> None:
        """Drop a registered agent (its open conversations keep running it; resuming its
        conversations then needs the Agent again): ``runtime.forget_agent("helper")``."""
        self._agents.pop(name, None)

    def register_agent_prefix(self, agent: Agent, *, salt: str = "") -> None:
        """Register the prompt prefix every conversation of ``agent`` starts with (system prompt
        and tools) as shared, for the conversations of tenant ``salt``."""
        # NOTE: rendered before a first user turn: without instructions the shared prefix is what
        # the template puts there (its default system prompt, or the tools' system turn); a
        # template that merges the system prompt into that turn shares it up to the turn's content.
        # The turn is not empty: Gemma 2's template trims it, closing the turn right after the
        # system prompt, as no real first turn does.
        prefix = render_for(self.renderer, agent, [Message.user("Hello.")], add_generation_prompt=False)
        if prefix.prefix_len:
            self.engine.register_prefix(prefix.token_ids[: prefix.prefix_len], salt=salt)

    async def open_conversation(self, agent: Agent, *, conversation_id: str | None = None,
                                salt: str = "") -> Conversation:
        """A new conversation for ``agent`` (stored, if the runtime has a store). ``salt``: the
        tenant whose cached prefixes the conversation may share (``open_conversation(agent, salt="team-a")``)."""
        self._know(agent, salt)
        sid = conversation_id or uuid.uuid4().hex
        if sid in self._conversations:
            raise UserError(f"conversation {sid!r} is already open in this runtime")
        if self.store is not None:
            await self.store.upsert_agent(
                agent.name, agent.instructions, [t.name for t in agent.tools], agent_settings(agent)
            )
            await self.store.create_conversation(agent.name, conversation_id=sid)
        return await self._attach(sid, agent, [], salt)

    async def resume(self, conversation_id: str, agent: Agent | None = None, *, salt: str = "") -> Conversation:
        """Reopen a stored conversation: its window of messages and, from the newest valid snapshot,
        its KV; ``conversation.resume_report`` says what came back. Raises ``ConversationNotFound`` for an
        unknown id. ``salt``: the tenant, as for ``open_conversation``. A conversation already open in this
        runtime is returned as it is; asking for it with another agent or salt raises ``UserError``."""
        store = self._require_store("resume")
        if conversation_id in self._conversations:
            return self._open_as(self._conversations[conversation_id], agent, salt)
        record = await store.get_conversation(conversation_id)
        if agent is not None:
            self._know(agent, salt)  # its shared prefix is registered like any other agent's
        agent = agent or await self._agent_for(record.agent_name)
        conversation = await self._attach(conversation_id, agent, await load_window(store, conversation_id), salt)
        repaired = await self._repair_if_free(conversation)
        rendered = conversation.render(agent, add_generation_prompt=False)
        prompt = rendered.token_ids
        restored = await restore_newest_snapshot(store, conversation_id, conversation.kv, prompt,
                                                 self.engine.fingerprint,
                                                 partial(reusable_kv_len, self.renderer, agent, self.engine),
                                                 namespace=kv_namespace(store, conversation))
        # NOTE: a break is KV lost: less restored than the newest snapshot held (without one,
        # than the history). The tokens a snapshot never held (the unfed last token of a cut
        # answer, the end-of-turn markup) are prefilled by the next call, but nothing is lost.
        # after a rewind the newest snapshot may hold more than the history now renders
        held = min(restored.held, len(prompt)) if restored.held else len(prompt)
        if restored.tokens < held:
            found = locate(restored.tokens, prompt, rendered, self.renderer.tokenizer, cause="partial restore")
            conversation.call_checks.hold(dataclasses.replace(found, held=held, kv_excerpt=""))
        conversation.resume_report = ResumeReport(len(conversation.window), restored.tokens, restored.skipped,
                                                  repaired, dict(restored.sources))
        where = ", ".join(f"{tokens} from {source}" for source, tokens in restored.sources.items())
        conversation.call_checks.note(f"resumed: {restored.tokens} of {len(prompt)} history tokens restored "
                                      f"from a snapshot{f' ({where})' if where else ''}")
        return conversation

    def _open_as(self, conversation: Conversation, agent: Agent | None, salt: str) -> Conversation:
        """``conversation`` (open here), now run by ``agent`` if one is given (as a resume of a
        closed conversation would be: its KV aligns with the new rendering by prefix);
        ``UserError`` for another salt, whose tenant the open KV cannot move to."""
        if salt != conversation.salt:
            raise UserError(
                f"conversation {conversation.id!r} is already open in this runtime for tenant salt "
                f"{conversation.salt!r}, not {salt!r}; its KV cannot change tenant: close_conversation it and "
                "resume it with the salt you want")
        if agent is not None:
            conversation.agent = agent
        return conversation

    async def _repair_if_free(self, conversation: Conversation) -> int:
        """Give orphaned tool calls their "interrupted" result, unless a live run holds the
        conversation (its calls are not orphans: that run will record their results)."""
        try:
            async with LeaseKeeper(self._require_store("resume"), conversation.id, self.holder,
                                   ttl_s=self.lease_ttl_s) as lease:
                conversation.lease_token = lease.token
                return await record_interrupted_calls(conversation)
        except ConversationBusy:
            return 0

    async def release_lease(self, conversation_id: str, *, force: bool = False) -> str | None:
        """Release a conversation's run lease. Without ``force`` only this runtime's own; with
        ``force=True`` whoever holds it (an operator's unlock, e.g. after a crash on another
        host): ``await runtime.release_lease("abc", force=True)``. Returns the previous holder
        when forced. A holder still running loses the conversation: its next write raises ``LeaseLost``
        (nothing of it is recorded after that), and a tool call it was running gets no result from it."""
        store = self._require_store("release_lease")
        if force:
            return await store.release_lease(conversation_id, force=True)
        await store.release_lease(conversation_id, self.holder)
        return None

    async def fork(self, conversation: Conversation | str, *, at: int | None = None, conversation_id: str | None = None,
                   agent: Agent | None = None, salt: str = "", edit: bool = False) -> Conversation:
        """A new stored conversation sharing ``conversation``'s messages 1..``at`` (default: all) —
        rows are shared, not copied — with their KV: the parent's live KV forked and trimmed when
        it is open here, else the newest snapshot up its lineage that covers a prefix. Both go on
        independently: ``branch = await runtime.fork(conversation, at=4)``; a fork of a fork works.
        ``edit=True``: the fork replaces what follows (its first call reports the KV it dropped).

        A conversation running here (a tool forking its own conversation) forks under its run's
        lease, at a message ``at`` of a turn already stored; without ``at`` it is a ``UserError``
        at once (the turn under way is half stored). Elsewhere the fork takes the lease for its
        read: a run in another process makes it wait, then ``ConversationBusy``."""
        store = self._require_store("fork")
        parent_id = conversation if isinstance(conversation, str) else conversation.id
        parent = self._conversations.get(parent_id)
        fence = None
        if parent is not None and parent.running:
            if at is None:
                raise UserError(f"conversation {parent_id!r} is running here: fork it once its run ends, or pass "
                                f"at=N to fork at a message of a turn already stored")
            fence = parent.lease_token
        record = await store.fork_conversation(parent_id, at=at, new_id=conversation_id, fence=fence)
        agent = agent or (parent.agent if parent is not None else await self._agent_for(record.agent_name))
        self._know(agent, salt)
        live = parent is not None and not parent.running
        kv = await parent.kv.fork() if live and parent is not None else None
        branch = await self._attach(record.id, agent, await load_window(store, record.id), salt, kv=kv)
        await seed_branch_kv(store, branch, parent_id=parent_id, fork_seq=record.fork_seq, forked=kv is not None,
                             edit=edit)
        return branch

    async def rewind(self, conversation: Conversation, *, before: int) -> int:
        """Take message ``before`` (a seq) and every later one out of the window — they stay
        stored, as this conversation's history — and trim the KV to where the window now
        diverges (never a re-prefill from zero); returns how many messages left. To keep them in
        the window of the original instead, ``fork(conversation, at=before - 1)``."""
        store = self._require_store("rewind")
        return await rewind_window(store, conversation, before, holder=self.holder, lease_ttl_s=self.lease_ttl_s)

    async def edit(self, conversation: Conversation, seq: int, content: str) -> tuple[Conversation, RunResult]:
        """Edit user message ``seq``: a fork at ``seq - 1`` answers ``content`` instead (the
        original stays as it was): ``branch, result = await runtime.edit(conversation, 3, "Paris?")``."""
        await check_user_message(self._require_store("edit"), conversation.id, seq)
        branch = await self.fork(conversation, at=seq - 1, agent=conversation.agent, edit=True)
        return branch, await self.run(branch, content)

    async def _attach(self, sid: str, agent: Agent, window: list, salt: str,  # type: ignore[type-arg]
                      kv: KVSession | None = None) -> Conversation:
        kv = kv if kv is not None else await self.engine.open_session(salt=salt)
        if sid in self._conversations:  # NOTE: two of one conversation would each pass the other's run guard
            await kv.close()
            raise ConversationBusy(sid, "another task of this process opened it meanwhile; use that one")
        conversation = Conversation(
            sid, agent, self.engine, kv, self.renderer, window=window,
            sink=StoreSink(self.store) if self.store is not None else None,
            on_window_change=StoreWindowHook(self.store) if self.store is not None else None, salt=salt,
            self_check=self.self_check,
        )
        self._conversations[sid] = conversation
        return conversation

    async def _agent_for(self, name: str) -> Agent:
        """The registered agent, else the stored one rebuilt (built-in tools and policies only;
        ``UserError`` says to pass the Agent itself otherwise)."""
        if name in self._agents:
            return self._agents[name]
        agent = agent_from_record(await self._require_store("resume").get_agent(name))
        self.add_agent(agent)
        return agent

    def _require_store(self, action: str) -> Store:
        if self.store is None:
            raise UserError(f"{action} needs a store: Runtime(engine, store=Store.from_env())")
        return self.store

    async def run(self, conversation: Conversation, user_input: RunInput | Decisions, *,
                  continue_from: int | None = None) -> RunResult:
        """Run the conversation's agent on ``user_input`` to its final answer: a user message's text,
        or messages — OpenAI chat dicts or ``Message``s, e.g. the results of the calls a run
        left pending (``result.pending_tool_calls``)::

            result = await runtime.run(conversation, "Weather in Paris?")
            if result.finish_reason == "tool_calls":
                call = result.pending_tool_calls[0]
                result = await runtime.run(conversation, [{"role": "tool", "tool_call_id": call.id, "content": "18 C"}])

        A message that cannot follow the history (a user turn before pending results, a result
        for no pending call) raises ``UserError`` and records nothing. ``Decisions`` about calls
        waiting for approval continue a run that stopped on them (``approve`` / ``reject``).
        ``continue_from``: see ``run_stream``."""
        result: RunResult | None = None
        async for event in self.run_stream(conversation, user_input, continue_from=continue_from):
            if isinstance(event, RunFinished):
                result = event.result
        assert result is not None
        return result

    async def approve(self, conversation: Conversation, call_id: str) -> RunResult:
        """Run a call that waited for approval and continue the run: once no call waits, the
        model goes on on the same KV (``finish_reason="approval_required"`` again while others
        wait): ``result = await runtime.approve(conversation, result.pending_approvals[0].id)``."""
        return await self.run(conversation, Decisions(approve=[call_id]))

    async def reject(self, conversation: Conversation, call_id: str, reason: str = "") -> RunResult:
        """Refuse a call that waited for approval: the model reads that it was rejected (and
        ``reason``) and the run continues as with ``approve``."""
        return await self.run(conversation, Decisions(reject={call_id: reason}))

    def pending_approvals(self, conversation: Conversation) -> tuple[ToolCall, ...]:
        """The conversation's calls waiting for approval (also after a resume in another process)."""
        return awaiting_approval(conversation.agent, conversation.messages)

    async def run_stream(self, conversation: Conversation, user_input: RunInput | Decisions, *,
                         continue_from: int | None = None) -> AsyncGenerator[RunEvent, None]:
        """The one way to run a conversation: yields typed events, the last ``RunFinished``.

        With a store the run holds the conversation's lease (a heartbeat renews it), first reloads
        a window another process changed and gives interrupted tool calls their result, and
        snapshots the KV when it ends. Close the stream to stop early (``aclosing``).
        ``continue_from=seq`` (stored conversations) continues from that message: later ones — e.g.
        the input of a run that never finished — leave the window first (``Store.rewind``); when a
        stored response covers a later one (another process continued first) the run raises
        ``ResponseSuperseded`` and changes nothing. A conversation another process runs is
        waited for up to ``lease_wait_s``, then ``ConversationBusy``."""
        if continue_from is not None and self.store is None:
            raise UserError("continue_from needs a store: Runtime(engine, store=Store.from_env())")
        # NOTE: the in-process guard comes first: a second run here must not touch (and then
        # release) the lease the first run holds.
        async with conversation.run_guard():
            run_span = conversation.trace_span = tracing.start("agentkv.run", conversation_id=conversation.id,
                                                               agent=conversation.agent.name)
            try:
                async with self._stored_run(conversation, continue_from):
                    calls = (CallLog(self.store, conversation.id, fence=conversation.lease_token)
                             if self.store is not None else None)
                    async with aclosing(run_turns(conversation.agent, conversation, user_input)) as events:
                        async for event in events:
                            if calls is not None:
                                await calls.see(event)
                            if isinstance(event, RunFinished):
                                run_span.set(finish_reason=event.result.finish_reason,
                                             model_calls=len(event.result.call_metrics))
                            yield event
            except BaseException as error:
                run_span.fail(error)
                raise
            finally:
                conversation.trace_span = None
                run_span.end()

    @asynccontextmanager
    async def _stored_run(self, conversation: Conversation, continue_from: int | None) -> AsyncIterator[None]:
        """What a run does around its turns when there is a store (nothing without one)."""
        if self.store is None:
            yield
            return
        async with LeaseKeeper(self.store, conversation.id, self.holder, ttl_s=self.lease_ttl_s,
                               wait_s=self.lease_wait_s) as lease:
            conversation.lease_token = lease.token
            began = False
            try:
                if continue_from is not None:  # NOTE: a stored response after it: ResponseSuperseded
                    await self.store.rewind(conversation.id, continue_from, keep_responses=True, fence=lease.token)
                if conversation.reload_window(await load_window(self.store, conversation.id)):
                    await catch_up_from_snapshot(self.store, conversation)  # another replica went on
                await record_interrupted_calls(conversation)
                began = True
                yield
            finally:
                # NOTE: a run refused before it began read nothing: its KV may be older than the
                # newest snapshot (another replica went on), and saving it would make it the newest
                if began:
                    with anyio.CancelScope(shield=True):
                        await save_snapshot(self.store, conversation)

    async def close_conversation(self, conversation: Conversation, *, snapshot: bool = False) -> None:
        """Release the conversation's KV (its stored history stays). ``snapshot=True`` first saves
        the KV unless a stored snapshot already holds it (a server's shutdown; a running
        conversation saves its own at the end of its run): ``await runtime.close_conversation(c, snapshot=True)``."""
        self._conversations.pop(conversation.id, None)
        if snapshot and self.store is not None and not conversation.running:
            await save_snapshot_unless_stored(self.store, conversation)
        await conversation.close()

    async def aclose(self) -> None:
        """Close every conversation (the engine and the store stay usable)."""
        for conversation in list(self._conversations.values()):
            await self.close_conversation(conversation)

