"""A reasoning model's ``<think>`` block: kept out of the answer, the calls and the streamed text,
streamed as ``ReasoningDelta``, returned as ``RunResult.reasoning`` and stored as
``Message.reasoning``.

The scripted tokenizer's ChatML template has no ``<think>``, so the runtime's renderer is told the
tags directly (``runtime.renderer.reasoning_tags``), as a template that handles them (Qwen3's)
makes ``ChatRenderer`` do. Its tiktoken vocabulary writes ``<think>`` as several tokens, so every
scripted stream here cuts the tags across deltas.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import Agent, Runtime, tool
from agentkv.chat.reasoning import ReasoningSplitter, split_reasoning, with_reasoning
from agentkv.chat.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI
from agentkv.chat.toolcalls import tool_call_grammar
from agentkv.chat.stream_filter import MarkupFilter, VisibleTokens
from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta, TokenLogprob
from agentkv.events import ReasoningDelta, RunFinished, TextDelta, ToolCalled
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

TAGS = ("<think>", "</think>")
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def call(name: str, **arguments: int) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def stream_split(pieces: list[str], tags: tuple[str, str] | None = TAGS) -> tuple[str, str]:
    splitter = ReasoningSplitter(tags)
    thought, answer = [], []
    for piece in pieces:
        t, a = splitter.feed(piece)
        thought.append(t)
        answer.append(a)
    t, a = splitter.flush()
    return "".join(thought) + t, "".join(answer) + a


# ---- splitting ------------------------------------------------------------------------------------


def test_a_leading_block_is_the_reasoning_and_the_newlines_after_it_leave_the_answer():
    assert split_reasoning("<think>\nplan\n</think>\n\nThe answer.", TAGS) == ("plan", "The answer.")
    assert split_reasoning("  <think>a\nb</think>x", TAGS) == ("a\nb", "x")


def test_an_empty_block_is_empty_reasoning_and_no_block_is_none():
    assert split_reasoning("<think>\n\n</think>\n\nHi", TAGS) == ("", "Hi")
    assert split_reasoning("Hi <think>x</think>", TAGS) == (None, "Hi <think>x</think>")
    assert split_reasoning("<think>\nplan\n</think>\n\nHi", None) == (None, "<think>\nplan\n</think>\n\nHi")


def test_an_unclosed_block_is_all_reasoning_and_no_answer():
    assert split_reasoning("<think>\nstill thinking\n", TAGS) == ("still thinking", "")


def test_a_tag_cut_across_deltas_is_held_until_whole():
    splitter = ReasoningSplitter(TAGS)
    assert splitter.feed("<thi") == ("", "")
    assert splitter.feed("nk>\npl") == ("pl", "")
    assert splitter.feed("an\n</th") == ("an", "")
    assert splitter.thinking
    assert splitter.feed("ink>\n") == ("", "")
    assert splitter.feed("\nThe answer.") == ("", "The answer.")
    assert splitter.flush() == ("", "")
    assert splitter.reasoning == "plan"


def test_text_that_only_looks_like_the_open_tag_streams_as_answer():
    assert stream_split(["<thi", "s is not a tag"]) == ("", "<this is not a tag")
    assert stream_split(["<thi"]) == ("", "<thi")


def test_streamed_answer_text_carries_the_answer_tokens_logprobs_only():
    pieces = ["<thi", "nk>", "\nplan", "\n</think>", "\n\n", "The", " answer", "<tool_call>", "{}"]
    visible = VisibleTokens(MarkupFilter("<tool_call>"), ReasoningSplitter(TAGS))
    steps = [visible.step(TokenDelta(i, piece, TokenLogprob(i, piece, -1.0))) for i, piece in enumerate(pieces)]
    steps.append(visible.end())
    assert "".join(s[0] for s in steps) == "plan" and "".join(s[1] for s in steps) == "The answer"
    assert [p.token for s in steps for p in s[2]] == ["The", " answer"]


PIECES = st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</th", "\n", "\n\n", " ", "a", "plan", "<", ">"])


@settings(max_examples=300, deadline=None)
@given(st.lists(PIECES, max_size=12), st.data())
def test_streaming_splits_as_split_reasoning_however_the_text_is_cut(parts, data):
    text = "".join(parts)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    reasoning, answer = split_reasoning(text, TAGS)
    assert stream_split(pieces) == (reasoning or "", answer)


# ---- grammar --------------------------------------------------------------------------------------


def test_without_tags_the_grammar_is_unchanged_and_hermes_stays_byte_identical():
    plain = HERMES.grammar(TOOLS, "auto")
    assert with_reasoning(plain, None) == plain == tool_call_grammar(TOOLS, "auto")


def test_with_tags_every_format_may_think_first_and_its_free_text_never_opens_a_block():
    for fmt in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI):
        for choice in ("auto", "required", "add"):
            grammar = with_reasoning(fmt.grammar(TOOLS, choice), TAGS)
            lines = grammar.splitlines()
            assert lines[0] == "start: reasoning? answer_after_reasoning"
            assert 'reasoning: "<think>" thinking "\\n\\n"' in lines
            assert [line for line in lines if line.startswith("TEXT:")] == (
                [] if choice != "auto" else [next(line for line in lines if line.startswith("TEXT:"))])
            assert all(line.endswith(r"& ~/\x3cthink\x3e(?s:.*)/") for line in lines if line.startswith("TEXT:"))


# ---- the runner -----------------------------------------------------------------------------------


async def reasoning_runtime(replies: list[str], store: Store | None = None) -> Runtime:
    runtime = Runtime(ScriptedEngine(replies), store)
    runtime.renderer.reasoning_tags = TAGS
    return runtime


async def test_thinking_streams_as_reasoning_and_stays_out_of_the_answer_text():
    plan = "first add, then check"
    runtime = await reasoning_runtime([f"<think>\n{plan}\n</think>\n\nThe answer."])
    conversation = await runtime.open_conversation(Agent(name="thinker"))
    events = [event async for event in runtime.run_stream(conversation, "Question?")]
    thoughts = [e for e in events if isinstance(e, ReasoningDelta)]
    assert "".join(e.text for e in thoughts) == plan and len(thoughts) > 1  # streamed, not at the end
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The answer."
    assert events.index(thoughts[-1]) < events.index(next(e for e in events if isinstance(e, TextDelta)))
    result = next(e.result for e in events if isinstance(e, RunFinished))
    assert (result.final_text, result.reasoning) == ("The answer.", plan)
    answer = result.new_messages[-1]
    assert (answer.content, answer.reasoning) == ("The answer.", plan)
    assert runtime.renderer.tokenizer.decode(answer.token_ids or ()).startswith(f"<think>\n{plan}\n</think>")


async def test_a_think_block_before_a_tool_call_is_neither_text_nor_arguments():
    thinking = "<think>\nI will write <tool_call> to add.\n</think>\n\n"
    runtime = await reasoning_runtime([thinking + call("add", a=2, b=3), "<think>\ndone\n</think>\n\nThe sum is 5."])
    conversation = await runtime.open_conversation(Agent(name="math", tools=[add]))
    events = [event async for event in runtime.run_stream(conversation, "2+3?")]
    called = [e.call for e in events if isinstance(e, ToolCalled)]
    assert [(c.name, c.arguments) for c in called] == [("add", {"a": 2, "b": 3})]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The sum is 5."
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "I will write <tool_call> to add.done"
    result = next(e.result for e in events if isinstance(e, RunFinished))
    assert (result.final_text, result.reasoning, result.finish_reason) == ("The sum is 5.", "done", "stop")
    first = result.new_messages[1]
    assert (first.content, first.reasoning, first.tool_calls[0].arguments) == ("", "I will write <tool_call> to add.",
                                                                               {"a": 2, "b": 3})


async def test_the_tool_grammar_lets_the_model_think_first():
    runtime = await reasoning_runtime([call("add", a=1, b=1), "2"])
    conversation = await runtime.open_conversation(Agent(name="math", tools=[add], tool_choice="required"))
    await runtime.run(conversation, "1+1?")
    grammars = runtime.engine.requested_grammars  # type: ignore[attr-defined]
    assert grammars and all(g.startswith("start: reasoning? answer_after_reasoning\n") for g in grammars)


async def test_a_model_without_tags_keeps_a_think_block_as_answer_text():
    runtime = Runtime(ScriptedEngine(["<think>x</think>\n\nHi"]))
    conversation = await runtime.open_conversation(Agent(name="plain"))
    result = await runtime.run(conversation, "hello")
    assert (result.final_text, result.reasoning) == ("<think>x</think>\n\nHi", None)


async def test_reasoning_cut_by_the_token_limit_is_all_reasoning_and_the_answer_is_empty():
    runtime = await reasoning_runtime(["<think>\nthinking for a very long time about it\n</think>\n\nlate"])
    agent = Agent(name="cut", generation=GenerationConfig(max_new_tokens=6))
    conversation = await runtime.open_conversation(agent)
    result = await runtime.run(conversation, "go")
    assert result.final_text == "" and result.finish_reason == "length"
    assert result.reasoning and "late" not in result.reasoning


async def test_the_stored_message_keeps_its_reasoning(tmp_path):
    async with Store(f"sqlite:///{tmp_path / 'db.sqlite'}") as store:
        runtime = await reasoning_runtime(["<think>\nplan\n</think>\n\nThe answer."], store)
        conversation = await runtime.open_conversation(Agent(name="thinker"), conversation_id="s1")
        await runtime.run(conversation, "Question?")
        stored = await store.messages("s1")
    assert [(m.message.role, m.message.content, m.message.reasoning) for m in stored] == [
        ("user", "Question?", None), ("assistant", "The answer.", "plan")]


class _AnyToken:
    """A constraint that allows every token of a 10-token vocabulary."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    def allowed_mask(self) -> Any:
        import numpy as np

        return np.ones(10, dtype=bool)

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)

    def is_finished(self) -> bool:
        return False


def test_a_thinking_budget_closes_the_block_once_it_is_spent_and_then_lets_the_answer_through() -> None:
    from agentkv.chat.reasoning import ThinkingBudget

    inner = _AnyToken()
    budget = ThinkingBudget(inner, open_id=1, close_id=2, max_tokens=3)
    budget.advance(1)
    for token in (5, 6, 7):
        assert budget.allowed_mask().all()
        budget.advance(token)
    assert budget.allowed_mask().tolist() == [i == 2 for i in range(10)]  # spent: only the close
    budget.advance(2)
    assert budget.allowed_mask().all() and inner.seen == [1, 5, 6, 7, 2]


def test_a_thinking_budget_ignores_answers_that_do_not_open_with_thinking() -> None:
    from agentkv.chat.reasoning import ThinkingBudget

    budget = ThinkingBudget(_AnyToken(), open_id=1, close_id=2, max_tokens=1)
    for token in (5, 1, 6, 7):
        budget.advance(token)
        assert budget.allowed_mask().all()
