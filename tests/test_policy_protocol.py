"""The policies over their protocol alone: a fake conversation (a list of messages, a word
tokenizer, a token list for a KV) runs each built-in policy with no engine and no runtime."""

from __future__ import annotations

import ast
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from agentkv import Message, Runtime, ToolCall
from agentkv.agent import Agent
from agentkv.chat.render import RenderedPrompt
from agentkv.engine.base import GenerationConfig, common_prefix_len
from agentkv.events import ContextCompacted
from agentkv.policies import SUMMARY_PREFIX, SlidingWindow, SummarizeAndReprefill, Truncation
from agentkv.policies.protocol import ContextPolicy, ConversationView, WindowItem
from agentkv.testing import ScriptedEngine

SPECIALS = {"system": 1, "user": 2, "assistant": 3, "tool": 4, "end": 5}
FIRST_WORD = 100
INSTRUCTIONS = "You are a terse assistant."


class WordTokenizer:
    """One token per whitespace-separated word; ids handed out on first sight."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = FIRST_WORD + len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        names = {v: f"<{k}>" for k, v in SPECIALS.items()}
        return " ".join(names[i] if i in names else self._words[i - FIRST_WORD] for i in ids)


@dataclass
class Entry:
    message: Message
    seq: int | None = None
    token_count: int = 0
    replaces: tuple[Entry, ...] = ()


@dataclass(frozen=True)
class Span:
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Prompt:
    token_ids: tuple[int, ...]
    spans: tuple[Span, ...]


@dataclass(frozen=True)
class FakeAgent:
    instructions: str = INSTRUCTIONS
    truncate_oversized_messages: bool = False


@dataclass(frozen=True)
class Generated:
    text: str


@dataclass
class FakeScratch:
    """Answers every prompt with the conversation's canned summary."""

    conversation: FakeConversation

    async def generate(self, prompt_tokens: Sequence[int], config: GenerationConfig) -> Generated:
        self.conversation.scratch_prompts.append(self.conversation.tokenizer.decode(prompt_tokens))
        return Generated(self.conversation.summary)


@dataclass
class FakeConversation:
    """``ConversationView[FakeAgent]`` over a list of messages: the KV is a token list, a drop
    deletes from it, a re-prefill replaces it and records how many tokens it fed."""

    history: list[Message]
    supports_drop: bool = True
    summary: str = "the user asked about rivers"
    id: str = "fake"
    context_len: int = 4096
    tokenizer: WordTokenizer = field(default_factory=WordTokenizer)
    window: list[Entry] = field(default_factory=list)
    kv_tokens: list[int] = field(default_factory=list)
    removed: list[Entry] = field(default_factory=list)
    dropped: list[tuple[int, int]] = field(default_factory=list)
    prefilled: list[int] = field(default_factory=list)
    scratch_prompts: list[str] = field(default_factory=list)
    open_scratches: int = 0

    def __post_init__(self) -> None:
        self.window = [Entry(m, i, self.message_tokens(m, position=i + 1)) for i, m in enumerate(self.history)]
        rendered = self.render(FakeAgent())
        self.kv_tokens = list(rendered.token_ids[: rendered.spans[-1].start])  # all but the new question

    @property
    def messages(self) -> list[Message]:
        return [entry.message for entry in self.window]

    def _message_ids(self, message: Message) -> list[int]:
        calls = " ".join(f"call {c.name} {json.dumps(c.arguments)}" for c in message.tool_calls)
        body = self.tokenizer.encode(f"{message.content} {calls}")
        return [SPECIALS[message.role], *body, SPECIALS["end"]]

    def render_messages(self, messages: Sequence[Message]) -> Prompt:
        ids: list[int] = []
        spans = []
        for message in messages:
            start = len(ids)
            ids += self._message_ids(message)
            spans.append(Span(start, len(ids)))
        return Prompt((*ids, SPECIALS["assistant"]), tuple(spans))

    def render(self, agent: FakeAgent) -> Prompt:
        return self.render_messages([Message.system(agent.instructions), *self.messages])

    def message_tokens(self, message: Message, *, position: int) -> int:
        return len(self._message_ids(message))

    async def replace_in_window(
        self, removed: Sequence[WindowItem], replacement: Message | None = None, *, token_count: int = 0
    ) -> Entry | None:
        positions = [i for i, e in enumerate(self.window) if any(e is r for r in removed)]
        assert len(positions) == len(removed), "a policy removed an entry that is not in the window"
        leaving = [self.window[i] for i in positions]
        entry = None if replacement is None else Entry(replacement, None, token_count, tuple(leaving))
        self.removed += leaving
        self.window = [e for i, e in enumerate(self.window) if i not in positions]
        if entry is not None:
            self.window.insert(positions[0], entry)
        return entry

    async def drop_spans(self, ranges: Sequence[tuple[int, int]]) -> None:
        for start, end in sorted(ranges, reverse=True):
            assert 0 <= start < end <= len(self.kv_tokens)
            del self.kv_tokens[start:end]
            self.dropped.append((start, end))

    async def realign(self, agent: FakeAgent) -> None:
        prompt = self.render(agent).token_ids
        self.prefilled.append(len(prompt) - common_prefix_len(self.kv_tokens, prompt))
        self.kv_tokens = list(prompt)

    @asynccontextmanager
    async def scratch(self) -> AsyncIterator[FakeScratch]:
        self.open_scratches += 1
        try:
            yield FakeScratch(self)
        finally:
            self.open_scratches -= 1


def words(n: int, seed: int = 0) -> str:
    return " ".join(f"w{seed}x{i}" for i in range(n))


CALL = ToolCall(name="lookup", arguments={"topic": "rivers"})


def conversation(**kwargs) -> FakeConversation:
    """System 7 tokens; q1 22, the call 6, its result 32, a1 12, q2 22, a2 12, q3 12;
    generation prompt 1: 126 tokens."""
    return FakeConversation(
        [
            Message.user(words(20, 1)),
            Message.assistant("", tool_calls=[CALL]),
            Message.tool(words(30, 2), tool_call_id=CALL.id, name="lookup"),
            Message.assistant(words(10, 3)),
            Message.user(words(20, 4)),
            Message.assistant(words(10, 5)),
            Message.user(words(10, 6)),
        ],
        **kwargs,
    )


# NOTE: target int(120 * 0.82) = 98: without q1 the prompt has 104 tokens, without q1 and the
# call message alone 98 — but a call leaves with its result (66), and the answer after it goes
# along (54): its question is gone.
LIMIT, LOW_WATER = 120, 0.82


async def compact(policy: ContextPolicy, fake: FakeConversation) -> list[ContextCompacted]:
    return [event async for event in policy.compact(fake, FakeAgent(), limit=LIMIT)]


def left_the_window(fake: FakeConversation) -> list[Message]:
    return [entry.message for entry in fake.removed]


def check_event(events: list[ContextCompacted], name: str) -> None:
    assert len(events) == 1
    event = events[0]
    assert (event.policy, event.fallback, event.fallback_reason) == (name, None, None)
    assert (event.tokens_before, event.tokens_after, event.messages_removed) == (126, 54, 4)


async def test_truncation_removes_the_call_with_its_result_and_reprefills_after_the_system_prompt():
    fake = conversation()
    events = await compact(Truncation(low_water=LOW_WATER), fake)
    check_event(events, "truncation")
    assert left_the_window(fake) == fake.history[:4]  # q1, the call, its result, a1
    assert fake.messages == fake.history[4:]
    assert fake.kv_tokens == list(fake.render(FakeAgent()).token_ids)
    assert fake.prefilled == [54 - 8]  # all after the system prompt and q2's role token (q1's too)
    assert not fake.dropped


async def test_sliding_window_drops_the_same_messages_from_the_kv_without_reprefill():
    fake = conversation()
    kv_before = list(fake.kv_tokens)
    events = await compact(SlidingWindow(low_water=LOW_WATER), fake)
    check_event(events, "sliding_window")
    assert left_the_window(fake) == fake.history[:4]
    assert fake.dropped == [(7, 7 + 22 + 6 + 32 + 12)]  # one span, right after the sink
    assert fake.kv_tokens == kv_before[:7] + kv_before[79:]
    prompt = fake.render(FakeAgent()).token_ids
    assert common_prefix_len(fake.kv_tokens, prompt) == len(fake.kv_tokens)
    assert not fake.prefilled


async def test_sliding_window_falls_back_to_truncation_when_the_kv_cannot_drop():
    fake = conversation(supports_drop=False)
    [event] = await compact(SlidingWindow(low_water=LOW_WATER), fake)
    assert (event.policy, event.fallback) == ("sliding_window", "truncation")
    assert "cannot drop KV spans" in event.fallback_reason
    assert left_the_window(fake) == fake.history[:4]
    assert not fake.dropped and fake.prefilled == [54 - 8]


async def test_summary_takes_the_place_of_the_call_its_result_and_their_neighbours():
    fake = conversation()
    events = await compact(SummarizeAndReprefill(low_water=LOW_WATER, max_summary_tokens=8), fake)
    [event] = events
    assert (event.policy, event.fallback, event.fallback_reason) == ("summarize_and_reprefill", None, None)
    assert event.messages_removed == 4
    assert left_the_window(fake) == fake.history[:4]
    summary = fake.window[0]
    assert summary.message == Message.system(f"{SUMMARY_PREFIX} {fake.summary}")
    assert summary.replaces == tuple(fake.removed) and summary.token_count == 1 + 9 + 1
    assert fake.messages[1:] == fake.history[4:]
    assert len(fake.scratch_prompts) == 1 and "Summarise this conversation." in fake.scratch_prompts[0]
    assert "Assistant called tool lookup" in fake.scratch_prompts[0] and fake.open_scratches == 0  # closed
    assert fake.prefilled == [event.tokens_after - 7]  # the system prompt's KV was kept


async def test_an_empty_summary_falls_back_to_truncation():
    fake = conversation(summary="  ")
    [event] = await compact(SummarizeAndReprefill(low_water=LOW_WATER, max_summary_tokens=8), fake)
    assert event.fallback == "truncation" and "no usable summary" in event.fallback_reason
    assert len(fake.scratch_prompts) == 2 and fake.open_scratches == 0  # two attempts, closed
    assert not any(m.content.startswith(SUMMARY_PREFIX) for m in fake.messages)
    assert left_the_window(fake) == fake.history[:4]


async def test_the_fake_and_the_real_session_both_satisfy_the_protocol():
    assert isinstance(conversation(), ConversationView)
    assert all(isinstance(p, ContextPolicy) for p in (Truncation(), SlidingWindow(), SummarizeAndReprefill()))
    runtime = Runtime(ScriptedEngine(max_context_len=512))
    try:
        session = await runtime.open_conversation(Agent(name="protocol"))
        assert isinstance(session, ConversationView)
        assert isinstance(session.render(session.agent), RenderedPrompt)
    finally:
        await runtime.aclose()


ALLOWED = (
    "agentkv.policies", "agentkv.chat.messages", "agentkv.events", "agentkv.errors", "agentkv.engine.base"
)


def test_policies_import_only_their_protocol_and_the_layers_it_names():
    """Not even under TYPE_CHECKING: the agent, the conversation, the renderer and the engine's
    sessions are reached through ``agentkv.policies.protocol`` only."""
    package = Path(__file__).resolve().parent.parent / "agentkv" / "policies"
    for path in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("agentkv"):
                assert node.module.startswith(ALLOWED), f"{path.name} imports {node.module}"
                if node.module == "agentkv.engine.base":
                    assert {a.name for a in node.names} <= {"GenerationConfig", "common_prefix_len"}
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.startswith("agentkv")]
                assert all(name.startswith(ALLOWED) for name in names), f"{path.name} imports {names}"
