"""Conversation: one conversation — its KV session, its message window, and where messages are recorded.

Opened by ``Runtime.open_conversation(agent)`` (or ``Runtime.resume(id)``) and run by the runtime::

    conversation = await runtime.open_conversation(agent)
    result = await runtime.run(conversation, "What is 2+2?")
    print([m.role for m in conversation.window])

Only one run may use a conversation at a time: a second concurrent run raises ``ConversationBusy``
rather than queueing behind the first (a queued run would answer a stale history).

``Conversation`` is the ``ConversationView`` that context policies work on
(``agentkv.policies.protocol``): the methods under "For context policies" are that protocol's
thin delegations to the KV session, the engine and the renderer.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

from agentkv.chat.messages import Message
from agentkv.engine.base import Engine, KVSession
from agentkv.errors import ConversationBusy, UserError
from agentkv.observe.cache_breaks import CacheBreak, Cause, find_break
from agentkv.observe.tracing import Span
from agentkv.result import ResumeReport
from agentkv.run.call_checks import CallChecks

if TYPE_CHECKING:
    from agentkv.agent import Agent
    from agentkv.chat.render import ChatRenderer, RenderedPrompt
    from agentkv.engine.base import Tokenizer
    from agentkv.policies.protocol import WindowItem


@dataclass
class WindowEntry:
    """A message in the window and its row number in the store (None when not stored)."""

    message: Message
    seq: int | None = None
    token_count: int = 0
    replaces: tuple[WindowEntry, ...] = ()
    """The entries this one took the place of: a summary's sources, or the original of a
    message cut to fit the window (empty for an ordinary message)."""


def render_for(renderer: ChatRenderer, agent: Agent, messages: Sequence[Message], *,
               add_generation_prompt: bool = True) -> RenderedPrompt:
    """The prompt ``agent`` sends over ``messages``: its system turn (none for
    ``instructions=None``) and its tools, then the messages."""
    system = [] if agent.instructions is None else [Message.system(agent.instructions)]
    tools = agent.tool_schemas if agent.tool_choice != "none" else []
    return renderer.render([*system, *messages], tools=tools, add_generation_prompt=add_generation_prompt)


MessageSink = Callable[["Conversation", Message, int, bool], Awaitable[int | None]]
"""``(conversation, message, token_count, in_window) -> seq``: persists a message (the store's hook)."""

WindowChange = Callable[["Conversation", list[WindowEntry], "WindowEntry | None"], Awaitable[None]]
"""``(conversation, removed, replacement)``: a policy is taking ``removed`` out of the window and,
if not None, putting ``replacement`` (a summary, or a message cut to fit; ``replacement.replaces``
lists what it replaces) in their place. Awaited before the window changes; it may set
``replacement.seq`` once it has stored the new message."""


class Conversation:
    """A conversation: agent, KV session, and the messages currently in the context window."""

    def __init__(
        self,
        conversation_id: str,
        agent: Agent,
        engine: Engine,
        kv: KVSession,
        renderer: ChatRenderer,
        *,
        sink: MessageSink | None = None,
        on_window_change: WindowChange | None = None,
        window: list[WindowEntry] | None = None,
        salt: str = "",
        self_check: float = 0.0,
    ) -> None:
        """``sink`` persists each recorded message and ``on_window_change`` each compaction (the
        runtime passes the store's; both None keeps the conversation in memory only); ``salt``:
        the tenant whose cached prefixes its KV session shares; ``self_check``: the fraction of
        its model calls that self-check mode checks."""
        self.id = conversation_id
        self.agent = agent
        self.engine = engine
        self.kv = kv
        self.renderer = renderer
        self.window: list[WindowEntry] = window or []
        self.salt = salt
        """The tenant salt its KV session was opened with (``Runtime.open_conversation(salt=)``)."""
        self.lease_token: int | None = None
        """The fencing token of the store lease its newest run took (None: writes unfenced): the
        store refuses its writes (``LeaseLost``) once another holder has taken the lease since."""
        self._sink = sink
        self._running = False
        self.resume_report: ResumeReport | None = None
        """What ``Runtime.resume`` found for this conversation (None if it was opened, not resumed)."""
        self.on_window_change: WindowChange | None = on_window_change
        """Called by context policies before messages leave the window (the store marks them)."""
        self.call_checks = CallChecks(self_check=self_check)
        """What its model calls carry from one to the next: the break the next one reports, the
        operations since the last self-check, the self-check rate (``agentkv.run.call_checks``)."""
        self.trace_span: Span | None = None
        """The span of the run in progress (``agentkv.observe.tracing``): the parent of its calls' spans."""

    @property
    def context_len(self) -> int:
        """The engine's context length: the hard ceiling for any prompt."""
        return self.engine.max_context_len

    @property
    def messages(self) -> list[Message]:
        """The messages in the window, oldest first (the system prompt is not among them)."""
        return [entry.message for entry in self.window]

    async def record(self, message: Message, *, token_count: int | None = None) -> WindowEntry:
        """Append ``message`` to the window and persist it (committed when this returns).
        ``token_count`` defaults to the tokens of the message's rendered span."""
        if token_count is None:
            token_count = self.renderer.message_tokens(message, position=len(self.window) + 1)
        seq = await self._sink(self, message, token_count, True) if self._sink else None
        entry = WindowEntry(message, seq, token_count)
        self.window.append(entry)
        return entry

    async def replace_in_window(
        self, removed: Sequence[WindowItem], replacement: Message | None = None, *, token_count: int = 0
    ) -> WindowEntry | None:
        """Take ``removed`` out of the window; put ``replacement`` (if any) where the first was.

        ``await conversation.replace_in_window(conversation.window[:2], Message.system("Summary of ..."))``.
        ``on_window_change`` is awaited first: if it raises, the window is unchanged. Returns the
        replacement's entry. ``UserError`` if an entry is not in the window.
        """
        gone = {id(entry) for entry in removed}
        positions = [i for i, entry in enumerate(self.window) if id(entry) in gone]
        if len(positions) != len(gone) or len(gone) != len(removed):
            raise UserError("replace_in_window: every removed entry must be in the window, once")
        leaving = [self.window[i] for i in positions]  # the entries themselves, in window order
        entry = None
        if replacement is not None:
            entry = WindowEntry(replacement, None, token_count, replaces=tuple(leaving))
        if self.on_window_change is not None:
            await self.on_window_change(self, leaving, entry)
        kept = [e for e in self.window if id(e) not in gone]
        if entry is not None:
            kept.insert(positions[0] if positions else len(kept), entry)
        self.window[:] = kept
        return entry

    def reload_window(self, entries: list[WindowEntry]) -> bool:
        """Take the stored window when it differs from ours (another process ran this conversation);
        the KV realigns by itself on the next model call. Returns whether anything changed."""
        if [e.seq for e in entries] == [e.seq for e in self.window]:
            return False
        self.window[:] = entries
        return True

    def note_break(self, agent: Agent, cause: Cause) -> CacheBreak | None:
        """Record (for the next model call to report) where ``render(agent)`` leaves the KV, before
        an operation drops what it held past there; returns it (None: nothing to drop)."""
        found = find_break(self.kv.tokens, self.render(agent, add_generation_prompt=False), self.renderer.tokenizer,
                           cause=cause)
        if found is not None:
            self.call_checks.hold(found)
        return found

    def render(self, agent: Agent, *, add_generation_prompt: bool = True) -> RenderedPrompt:
        """The prompt for ``agent`` over the current window (system prompt + tools first)."""
        return self.render_with(agent, self.messages, add_generation_prompt=add_generation_prompt)

    def render_with(
        self, agent: Agent, messages: Sequence[Message], *, add_generation_prompt: bool = True
    ) -> RenderedPrompt:
        """The prompt for ``agent`` over ``messages`` instead of the window (e.g. to size a
        message before recording it): ``conversation.render_with(agent, [Message.user("hi")])``."""
        return render_for(self.renderer, agent, messages, add_generation_prompt=add_generation_prompt)

    # ---- For context policies (``agentkv.policies.protocol.ConversationView``) ---------------------

    def render_messages(self, messages: Sequence[Message]) -> RenderedPrompt:
        """``messages`` alone through the chat template, no system prompt or tools added (a
        summariser's prompt): ``conversation.render_messages([Message.user("Summarise: ...")])``."""
        return self.renderer.render(messages)

    def message_tokens(self, message: Message, *, position: int) -> int:
        """Tokens of ``message``'s span rendered at ``position`` (1 = first after the system
        prompt); see ``ChatRenderer.message_tokens``."""
        return self.renderer.message_tokens(message, position=position)

    @property
    def tokenizer(self) -> Tokenizer:
        """The renderer's tokenizer (plain text ↔ ids)."""
        return self.renderer.tokenizer

    @property
    def kv_tokens(self) -> tuple[int, ...]:
        """``kv.tokens``: the tokens whose KV this conversation holds."""
        return self.kv.tokens

    @property
    def supports_drop(self) -> bool:
        """Whether the KV session can drop spans (``KVSession.supports_drop``)."""
        return self.kv.supports_drop

    async def drop_spans(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Drop each ``(start, end)`` range of ``kv_tokens`` from the KV by span drop + RoPE shift
        (``KVSession.drop``; no re-prefill). Raises ``UserError`` for overlapping ranges (before
        any drop) and whatever ``KVSession.drop`` raises (ranges dropped before stay dropped)."""
        ordered = sorted(ranges)
        for (_, end), (start, _) in pairwise(ordered):
            if start < end:
                raise UserError(f"drop_spans: ranges overlap: {ordered}")
        for start, end in reversed(ordered):  # NOTE: last first, so earlier offsets stay valid
            await self.kv.drop(start, end)

    async def realign(self, agent: Agent) -> None:
        """Bring the KV to ``render(agent)``: trim to the common prefix, prefill the rest, so the
        next model call prefills nothing."""
        self.note_break(agent, "window compaction")
        await self.kv.prefill(self.render(agent).token_ids)

    @asynccontextmanager
    async def scratch(self) -> AsyncIterator[KVSession]:
        """A temporary KV session on the same engine, closed when the block ends (this
        conversation's KV is untouched): ``async with conversation.scratch() as s: await s.generate(...)``."""
        scratch = await self.engine.open_session()
        try:
            yield scratch
        finally:
            await scratch.close()

    # ---- Runs ---------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        """True while a run holds the conversation (``run_guard``)."""
        return self._running

    @asynccontextmanager
    async def run_guard(self) -> AsyncIterator[None]:
        """Mark the conversation as running for the block; a concurrent run raises ``ConversationBusy``."""
        if self._running:
            raise ConversationBusy(self.id, "another run in this process")
        self._running = True
        try:
            yield
        finally:
            self._running = False

    async def close(self) -> None:
        """Release the KV session."""
        await self.kv.close()
