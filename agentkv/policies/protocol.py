"""What a context policy may ask of a conversation and its agent: the policies' whole view of the runtime.

Policies decide *which messages* leave the window; everything else they need — rendering, token
counts, the KV's token log and span drop, re-prefill, a scratch session for summaries, the
context length — is named here, so a policy never reaches into the conversation's KV session,
engine or renderer, and never imports ``agentkv.agent`` or ``agentkv.run.conversation``.
``Conversation`` satisfies ``ConversationView``; a test can satisfy it with a list of messages and a
fake tokenizer::

    async for event in Truncation().compact(conversation, agent, limit=700):
        print(event.policy, event.tokens_before, "→", event.tokens_after)

This module imports nothing from ``agentkv`` but messages, events and the engine's
``GenerationConfig``, so anything may import it without a cycle.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Protocol, TypeVar, runtime_checkable

from agentkv.chat.messages import Message
from agentkv.engine.base import GenerationConfig
from agentkv.events import ContextCompacted


class PolicyAgent(Protocol):
    """The agent fields a policy reads itself (the conversation renders the agent's prompt)."""

    @property
    def truncate_oversized_messages(self) -> bool:
        """Cut a protected message that alone overflows the budget instead of raising."""


AgentT = TypeVar("AgentT", bound=PolicyAgent)
"""The agent a policy passes through to its conversation (``Agent`` for ``Conversation``)."""
AgentT_contra = TypeVar("AgentT_contra", bound=PolicyAgent, contravariant=True)


class WindowItem(Protocol):
    """A message in the window (``WindowEntry`` in the runtime). Read-only to policies."""

    @property
    def message(self) -> Message:
        """The message as the model sees it."""

    @property
    def seq(self) -> int | None:
        """Its row in the store (None when not stored)."""

    @property
    def token_count(self) -> int:
        """Tokens of its rendered span."""

    @property
    def replaces(self) -> Sequence[WindowItem]:
        """The entries it took the place of (a summary's sources, a cut message's original)."""


class TokenSpan(Protocol):
    """Where one message's tokens are in a rendered prompt: ``start`` inclusive, ``end`` not."""

    @property
    def start(self) -> int: ...

    @property
    def end(self) -> int: ...

    def __len__(self) -> int:
        """``end - start``."""


class Rendered(Protocol):
    """A rendered prompt: token ids and one span per message."""

    @property
    def token_ids(self) -> Sequence[int]:
        """The whole prompt, generation prompt included."""

    @property
    def spans(self) -> Sequence[TokenSpan]:
        """One per rendered message, in order: span 0 is the system prompt, span ``k + 1`` is
        window entry ``k``."""


class TextTokenizer(Protocol):
    """Plain text ↔ token ids (no special tokens, no template)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class GeneratedText(Protocol):
    """What a scratch generation returns (``GenerationResult`` in the engine)."""

    @property
    def text(self) -> str: ...


class ScratchSession(Protocol):
    """A temporary KV session beside the conversation's own (whose KV it never touches)."""

    async def generate(self, prompt_tokens: Sequence[int], config: GenerationConfig) -> GeneratedText:
        """Prefill ``prompt_tokens`` and decode per ``config``; may raise (a summary attempt
        that fails is retried or abandoned by the policy)."""


@runtime_checkable
class ConversationView(Protocol[AgentT_contra]):
    """Everything a policy may ask of a conversation. Methods that change the window or the KV
    say so; all of them are called with the conversation's run in progress (the runner holds
    the run guard), so nothing else changes it meanwhile."""

    # ---- the window ------------------------------------------------------------------------

    @property
    def id(self) -> str:
        """The conversation's id (for logs)."""

    @property
    def window(self) -> Sequence[WindowItem]:
        """The entries in the context window, oldest first (the system prompt is not one)."""

    @property
    def messages(self) -> Sequence[Message]:
        """``[entry.message for entry in window]``."""

    async def replace_in_window(
        self, removed: Sequence[WindowItem], replacement: Message | None = None, *, token_count: int = 0
    ) -> WindowItem | None:
        """Take ``removed`` (entries of ``window``) out of the window and put ``replacement`` (if
        any, ``token_count`` tokens) where the first was; return its entry. Mutates the window;
        the store keeps what left (nothing is deleted). Raises ``UserError`` for an entry not in
        the window; if the store's hook fails, the window is unchanged and the error propagates."""

    # ---- rendering and tokens ----------------------------------------------------------------

    def render(self, agent: AgentT_contra) -> Rendered:
        """The prompt the next model call would send for ``agent`` (no state change)."""

    def render_messages(self, messages: Sequence[Message]) -> Rendered:
        """``messages`` alone through the chat template (no agent system prompt, no tools; with
        the generation prompt), e.g. a summariser's prompt. No state change."""

    def message_tokens(self, message: Message, *, position: int) -> int:
        """Tokens of ``message``'s span when rendered at ``position`` (1 = first after the
        system prompt), for a replacement's ``token_count``. No state change."""

    @property
    def tokenizer(self) -> TextTokenizer:
        """The model's tokenizer, for cutting and chunking text by tokens."""

    @property
    def context_len(self) -> int:
        """The model's context length: the hard ceiling for any prompt, a scratch one included."""

    # ---- the KV --------------------------------------------------------------------------------

    @property
    def kv_tokens(self) -> Sequence[int]:
        """The KV's token log: exactly the tokens whose KV the conversation holds."""

    @property
    def supports_drop(self) -> bool:
        """True when ``drop_spans`` is available (it may still raise ``KVShiftUnsupported``)."""

    async def drop_spans(self, ranges: Sequence[tuple[int, int]]) -> None:
        """Remove each ``(start, end)`` range of ``kv_tokens`` (non-overlapping, any order) from
        the KV without re-prefill: span drop + RoPE shift, the KV marked shifted. Mutates the KV.
        Raises ``UserError`` for a range outside ``kv_tokens`` or overlapping another, and
        ``KVShiftUnsupported`` when the KV cannot shift (ranges dropped before it stay dropped;
        ``realign`` makes the KV consistent with the prompt again)."""

    async def realign(self, agent: AgentT_contra) -> None:
        """Bring the KV to ``render(agent)``: trim to the common prefix, prefill the rest, so
        the next model call prefills nothing. Mutates the KV."""

    def scratch(self) -> AbstractAsyncContextManager[ScratchSession]:
        """A temporary session on the same model, closed when the block ends:
        ``async with conversation.scratch() as s: await s.generate(ids, config)``."""


@runtime_checkable
class ContextPolicy(Protocol):
    """Decides which messages leave the window when the prompt outgrows its budget."""

    name: str
    """Short name reported in ``ContextCompacted.policy``."""

    def compact(
        self, conversation: ConversationView[AgentT], agent: AgentT, *, limit: int
    ) -> AsyncGenerator[ContextCompacted, None]:
        """Bring ``conversation.render(agent)`` to at most ``limit`` tokens (to the low-water mark if
        possible); yield one event per compaction. Messages that leave the window are reported
        through ``conversation.replace_in_window`` (never deleted from the store). Raises
        ``ContextOverflowError`` when the protected messages alone exceed ``limit``."""
