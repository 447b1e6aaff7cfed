"""Context-window policies: invariants on random scripted conversations, each policy's mechanics,
oversized messages, and each policy on the real model crossing the limit several times."""

from __future__ import annotations

import json
import logging
from collections import deque
from dataclasses import dataclass, field

import hypothesis
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv import Agent, Message, Runtime, ToolCall, tool
from agentkv.run.conversation import Conversation, WindowEntry
from agentkv.engine.base import common_prefix_len
from agentkv.errors import ContextOverflowError, KVShiftUnsupported
from agentkv.events import ContextCompacted, ModelCallFinished
from agentkv.policies import (
    SUMMARY_PREFIX,
    SlidingWindow,
    SummarizeAndReprefill,
    Truncation,
    group_units,
    plan_removal,
)
from agentkv.testing import ScriptedEngine, ScriptedSession

VOCAB = ["river", "stone", "cloud", "maple", "signal", "orbit", "lantern", "harbor", "copper", "meadow"]
INSTRUCTIONS = "You are a helpful assistant. Use the lookup tool when asked for facts."
POLICIES = {"truncation": Truncation, "sliding_window": SlidingWindow, "summarize": SummarizeAndReprefill}


def words(n: int, seed: int = 0) -> str:
    return " ".join(VOCAB[(seed + i) % len(VOCAB)] for i in range(n))


def call_markup(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@tool
def lookup(size: int) -> str:
    """Look up ``size`` words of facts."""
    return words(size, seed=size)


@dataclass
class Harness:
    """A scripted conversation: queued replies for the main session, a fixed summary for others,
    and every invariant checked at each main-session model call."""

    agent: Agent
    engine: ScriptedEngine = field(default_factory=lambda: ScriptedEngine(max_context_len=8192))
    replies: deque[str] = field(default_factory=deque)
    removed: list[WindowEntry] = field(default_factory=list)
    recorded: list[Message] = field(default_factory=list)
    events: list[ContextCompacted] = field(default_factory=list)
    summary_text: str = "the user asked for facts about rivers and stones"
    summary_failure: str | Exception | None = None
    """What the summariser gets instead of ``summary_text``: an empty reply or an error."""
    session: Conversation | None = None
    runtime: Runtime | None = None
    cuts: int = 0
    """Messages cut to fit (their new content differs from what the KV may hold)."""

    async def open(self) -> Conversation:
        self.engine.add_replies(*([self.step] * 400))
        self.runtime = Runtime(self.engine)
        self.session = await self.runtime.open_conversation(self.agent)
        self.session.on_window_change = self.on_window_change
        return self.session

    async def on_window_change(self, session, removed, replacement) -> None:
        assert all(any(e is w for w in session.window) for e in removed)
        self.removed.extend(removed)
        if replacement is not None and not replacement.message.content.startswith(SUMMARY_PREFIX):
            self.cuts += 1

    def step(self, call) -> str:
        assert self.session is not None
        if call.session_id != self.session.kv.id:
            if isinstance(self.summary_failure, Exception):
                raise self.summary_failure
            return self.summary_text if self.summary_failure is None else self.summary_failure
        self.check_call(call)
        return self.replies.popleft()

    def check_call(self, call) -> None:
        limit = self.agent.max_prompt_len - self.agent.min_response_len
        assert len(call.prompt_ids) <= limit
        assert call.prompt_text.startswith(f"<|im_start|>system\n{INSTRUCTIONS}")
        assert_tool_pairs_whole(self.session.messages)

    async def turn(self, user_text: str, rounds: list[list[int]], answer: str) -> None:
        for sizes in rounds:
            self.replies.append("\n".join(call_markup("lookup", size=s) for s in sizes))
        self.replies.append(answer)
        cuts = self.cuts
        async for event in self.runtime.run_stream(self.session, user_text):
            if isinstance(event, ContextCompacted):
                self.events.append(event)
                self.check_after_compaction(event, cut=self.cuts > cuts)
                cuts = self.cuts
            elif event.type == "run_finished":
                self.recorded.extend(event.result.new_messages)

    def check_after_compaction(self, event: ContextCompacted, *, cut: bool) -> None:
        limit = self.agent.max_prompt_len - self.agent.min_response_len
        assert event.tokens_after <= limit < event.tokens_before
        # Nothing is re-prefilled: the KV is a prefix of the new prompt (unless a message the KV
        # already held was cut to fit: then the prompt legitimately diverges there).
        if event.policy == "sliding_window" and not cut:
            kv_tokens = self.session.kv.tokens
            assert common_prefix_len(kv_tokens, self.session.render(self.agent).token_ids) == len(kv_tokens)

    def check_nothing_lost(self) -> None:
        in_window = {id(m) for m in self.session.messages}
        reported = [id(e.message) for e in self.removed]
        assert len(reported) == len(set(reported)), "a message was reported twice"
        for message in self.recorded:
            assert id(message) in in_window or id(message) in set(reported)
        assert in_window.isdisjoint(reported)


def assert_tool_pairs_whole(messages: list[Message]) -> None:
    """Every tool result's call is in the window, and every call's results are."""
    call_ids = {c.id for m in messages if m.role == "assistant" for c in m.tool_calls}
    result_ids = {m.tool_call_id for m in messages if m.role == "tool"}
    assert result_ids <= call_ids, "a tool result lost its call"
    assert call_ids <= result_ids, "a tool call lost its result"


def make_agent(policy, *, max_prompt_len: int, **kwargs) -> Agent:
    return Agent(
        name="policy-test",
        instructions=INSTRUCTIONS,
        tools=[lookup],
        policy=policy,
        max_prompt_len=max_prompt_len,
        min_response_len=kwargs.pop("min_response_len", 32),
        max_model_calls=6,
        **kwargs,
    )


# ---- invariants on random conversations ----------------------------------------------------

turn_plan = st.tuples(
    st.integers(1, 160),  # user words
    st.lists(st.lists(st.integers(1, 120), min_size=1, max_size=2), max_size=2),  # tool rounds
    st.integers(1, 60),  # answer words
)


@pytest.mark.parametrize("policy_name", list(POLICIES))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    turns=st.lists(turn_plan, min_size=2, max_size=12),
    max_prompt_len=st.integers(560, 1200),
    low_water=st.floats(0.4, 0.9),
)
async def test_random_conversations_keep_budget_system_prompt_tool_pairs_and_every_message(
    policy_name, turns, max_prompt_len, low_water
):
    agent = make_agent(POLICIES[policy_name](low_water=low_water), max_prompt_len=max_prompt_len,
                       truncate_oversized_messages=True)
    harness = Harness(agent)
    await harness.open()
    for index, (user_words, rounds, answer_words) in enumerate(turns):
        await harness.turn(words(user_words, seed=index), rounds, words(answer_words, seed=index + 3))
    harness.check_nothing_lost()
    assert_tool_pairs_whole(harness.session.messages)
    assert {e.policy for e in harness.events} <= {POLICIES[policy_name].name}
    hypothesis.event(f"compactions: {min(len(harness.events), 3)}{'+' if len(harness.events) >= 3 else ''}")
    hypothesis.event(f"messages cut to fit: {'yes' if harness.cuts else 'no'}")


# ---- each policy's mechanics ----------------------------------------------------------------


async def run_turns(harness: Harness, count: int, user_words: int = 60) -> None:
    for index in range(count):
        await harness.turn(words(user_words, seed=index), [], words(30, seed=index))


async def test_truncation_compacts_to_the_low_water_mark_so_the_next_turn_does_not():
    agent = make_agent(Truncation(low_water=0.5), max_prompt_len=700)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 8)
    first = harness.events[0]
    assert first.policy == "truncation" and first.messages_removed >= 2
    assert first.tokens_after <= int(0.5 * (700 - 32))
    assert len(harness.events) < 8 // 2  # hysteresis: not every turn
    assert session.messages[0].role == "user"  # no answer left without its question
    harness.check_nothing_lost()


async def test_truncation_reprefills_inside_the_compaction_so_the_model_call_prefills_nothing():
    agent = make_agent(Truncation(), max_prompt_len=600)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 4)
    metrics = []
    harness.replies.append("ok")
    async for event in harness.runtime.run_stream(session, words(200)):
        if isinstance(event, ModelCallFinished):
            metrics.append(event.metrics)
        elif isinstance(event, ContextCompacted):
            harness.events.append(event)
    assert harness.events and metrics[0].prefilled_tokens <= 1


async def test_sliding_window_drops_spans_from_the_kv_without_reprefill():
    agent = make_agent(SlidingWindow(), max_prompt_len=600)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 3)
    kv_before = session.kv.tokens
    metrics = []
    harness.replies.append("ok")
    async for event in harness.runtime.run_stream(session, words(150)):
        if isinstance(event, ModelCallFinished):
            metrics.append(event.metrics)
        elif isinstance(event, ContextCompacted):
            harness.events.append(event)
            assert event.policy == "sliding_window"
    assert session.kv.shifted and session.kv.drops
    start, end = session.kv.drops[0]
    rendered_system = session.render(agent).spans[0]
    assert start == rendered_system.end  # the system prompt stays as the sink
    # only the new user turn (and generation prompt) was prefilled: the rest was reused
    assert metrics[0].reused_tokens >= len(kv_before) - (end - start) - 1
    assert metrics[0].prefilled_tokens < len(session.renderer.tokenizer.encode(words(150))) + 12


async def test_sliding_window_falls_back_to_truncation_when_the_session_cannot_drop(monkeypatch, caplog):
    monkeypatch.setattr(ScriptedSession, "supports_drop", property(lambda self: False))
    agent = make_agent(SlidingWindow(), max_prompt_len=600)
    harness = Harness(agent)
    session = await harness.open()
    with caplog.at_level(logging.WARNING, logger="agentkv.policies.sliding_window"):
        await run_turns(harness, 6)
    assert harness.events and all(e.policy == "sliding_window" for e in harness.events)
    assert all(e.fallback == "truncation" and "cannot drop KV spans" in e.fallback_reason for e in harness.events)
    assert "falling back to truncation" in caplog.text
    assert not session.kv.shifted
    harness.check_nothing_lost()


async def test_sliding_window_falls_back_when_the_rope_convention_is_unknown(monkeypatch, caplog):
    async def refuse(self, start, end):
        raise KVShiftUnsupported("no RoPE fits")

    monkeypatch.setattr(ScriptedSession, "drop", refuse)
    agent = make_agent(SlidingWindow(), max_prompt_len=600)
    harness = Harness(agent)
    await harness.open()
    with caplog.at_level(logging.WARNING, logger="agentkv.policies.sliding_window"):
        await run_turns(harness, 6)
    assert harness.events and all(e.fallback == "truncation" for e in harness.events)
    assert all(e.fallback_reason == "no RoPE fits" for e in harness.events)
    assert "no RoPE fits" in caplog.text
    harness.check_nothing_lost()


async def test_summary_replaces_the_oldest_messages_and_records_them():
    agent = make_agent(SummarizeAndReprefill(), max_prompt_len=700)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 6)
    assert harness.events[0].policy == "summarize_and_reprefill"
    summary = session.window[0]
    assert summary.message.role == "system" and summary.token_count > 0
    assert summary.message.content == f"{SUMMARY_PREFIX} {harness.summary_text}"
    assert summary.replaces and all(any(r is e for e in harness.removed) for r in summary.replaces)
    summariser_calls = [c for c in harness.engine.calls if c.session_id != session.kv.id]
    assert summariser_calls and "Summarise this conversation" in summariser_calls[0].prompt_text
    harness.check_nothing_lost()


async def test_summaries_are_written_in_bounded_chunks():
    agent = make_agent(SummarizeAndReprefill(chunk_tokens=60, max_summary_tokens=24), max_prompt_len=900)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 6, user_words=100)
    summariser_calls = [c for c in harness.engine.calls if c.session_id != session.kv.id]
    assert len(summariser_calls) >= 3
    tokenizer = session.renderer.tokenizer
    request_lengths = [len(tokenizer.encode(c.prompt_text)) for c in summariser_calls]
    assert max(request_lengths) <= 60 + 24 + 120  # chunk + previous summary + instructions


@pytest.mark.parametrize("failure", ["", RuntimeError("summariser crashed")])
async def test_failed_summaries_retry_a_bounded_number_of_times_then_truncate(failure, caplog):
    agent = make_agent(SummarizeAndReprefill(max_attempts=2), max_prompt_len=700)
    harness = Harness(agent, summary_failure=failure)
    session = await harness.open()
    with caplog.at_level(logging.WARNING, logger="agentkv.policies.summarize"):
        await run_turns(harness, 6)
    summariser_calls = [c for c in harness.engine.calls if c.session_id != session.kv.id]
    assert harness.events and all(e.policy == "summarize_and_reprefill" for e in harness.events)
    assert all(e.fallback == "truncation" and "no usable summary" in e.fallback_reason for e in harness.events)
    assert len(summariser_calls) == 2 * len(harness.events)
    assert "falling back to truncation" in caplog.text
    assert not any(m.content.startswith(SUMMARY_PREFIX) for m in session.messages)
    harness.check_nothing_lost()


# ---- oversized messages ----------------------------------------------------------------------


async def test_a_single_message_larger_than_the_window_raises_a_named_error():
    agent = make_agent(Truncation(), max_prompt_len=500)
    harness = Harness(agent)
    await harness.open()
    with pytest.raises(ContextOverflowError, match="truncate_oversized_messages") as info:
        await harness.turn(words(900), [], "never")
    assert info.value.limit == 500 - 32 and info.value.prompt_tokens > info.value.limit


async def test_an_opted_in_agent_cuts_the_oversized_message_with_a_visible_marker():
    agent = make_agent(SlidingWindow(), max_prompt_len=500, truncate_oversized_messages=True)
    harness = Harness(agent)
    session = await harness.open()
    await harness.turn(words(40), [], words(10))
    original = words(900, seed=5)
    await harness.turn(original, [], "done")
    cut = next(m for m in session.messages if m.role == "user" and "tokens truncated" in m.content)
    head, _, tail = cut.content.partition("\n[… ")
    assert original.startswith(head) and original.endswith(tail.partition("…]\n")[2])
    assert any(e.message.content == original for e in harness.removed)
    replaced = next(e for e in session.window if e.message is cut)
    assert replaced.replaces[0].message.content == original
    harness.check_nothing_lost()


async def test_latest_tool_results_too_large_are_cut_too_and_stay_paired():
    agent = make_agent(Truncation(), max_prompt_len=600, truncate_oversized_messages=True)
    harness = Harness(agent)
    session = await harness.open()
    await harness.turn(words(20), [[2000]], "summarised")
    tool_messages = [m for m in session.messages if m.role == "tool"]
    assert len(tool_messages) == 1 and "tokens truncated" in tool_messages[0].content
    assert_tool_pairs_whole(session.messages)


# ---- selection ---------------------------------------------------------------------------------


def test_a_tool_call_and_its_results_form_one_unit():
    calls = [ToolCall(name="lookup", arguments={"size": 1}), ToolCall(name="lookup", arguments={"size": 2})]
    messages = [
        Message.user("q"),
        Message.assistant("", tool_calls=calls),
        Message.tool("a", tool_call_id=calls[0].id, name="lookup"),
        Message.tool("b", tool_call_id=calls[1].id, name="lookup"),
        Message.assistant("answer"),
        Message.user("next"),
    ]
    assert [(u.first, u.end) for u in group_units(messages)] == [(0, 1), (1, 4), (4, 5), (5, 6)]


async def test_the_newest_user_turn_and_latest_tool_results_are_never_planned_for_removal():
    agent = make_agent(Truncation(), max_prompt_len=4000)
    harness = Harness(agent)
    session = await harness.open()
    await harness.turn(words(30), [], words(5))
    await harness.turn(words(30), [[5], [6]], words(5))
    plan = plan_removal(session.window, session.render(agent), target=0)
    kept = [e for e in session.window if all(e is not r for r in plan.entries)]
    assert [e.message.role for e in kept] == ["user", "assistant"]  # newest user + the last unit
    assert kept[0].message is session.messages[2]


async def test_a_failing_window_hook_leaves_the_window_unchanged():
    agent = make_agent(Truncation(), max_prompt_len=4000)
    harness = Harness(agent)
    session = await harness.open()
    await run_turns(harness, 2)

    async def broken(session, removed, replacement):
        raise OSError("disk full")

    session.on_window_change = broken
    before = list(session.window)
    with pytest.raises(OSError):
        await session.replace_in_window(session.window[:2], Message.system(f"{SUMMARY_PREFIX} x"))
    assert session.window == before


# ---- real model ----------------------------------------------------------------------------------


