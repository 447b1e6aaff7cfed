"""The thinking-block grammar on the zoo Qwen3 (``<think>`` and ``</think>`` are ordinary added
tokens of its vocabulary, one token each): every tool-call format's grammar, wrapped by
``with_reasoning``, compiles with llguidance on that vocabulary and takes exactly the texts the
model may write — a think block (with ``</think>``-like text inside) then calls or an answer, or
no block — and refuses an answer where a call is required. The constraint is the engine's own
(``engine.make_constraint``), walked with the tokenizer's ids. On the random-weight model, a
grammar that forces the block streams it apart from the answer exactly as ``split_reasoning``
splits the whole text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentkv import GenerationConfig, Runtime, open_engine
from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.reasoning import ReasoningSplitter, split_reasoning, with_reasoning
from agentkv.chat.stream_filter import MarkupFilter, VisibleTokens
from agentkv.chat.tool_formats import HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI
from agentkv.chat.toolcalls import answer_grammar

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
TAGS = ("<think>", "</think>")
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'

_ENGINE: list[Any] = []


def qwen3() -> Any:
    if not _ENGINE:
        _ENGINE.append(open_engine(ZOO / "qwen3", exact=True, num_slots=2, prefix_cache_bytes=0,
                                   kv_cache_bytes=16 << 20))
    return _ENGINE[0]


def takes(grammar: str, text: str) -> bool:
    """True when the engine's constraint for ``grammar`` allows the ids of ``text`` one by one
    and accepts at the end."""
    engine = qwen3()
    constraint = engine.make_constraint(grammar)
    for token in engine.tokenizer.encode(text):
        if not constraint.allowed_mask()[token]:
            return False
        constraint.advance(token)
    return bool(constraint.is_accepting())


def test_the_think_tags_are_single_ordinary_tokens_of_the_zoo_qwen3():
    encode = qwen3().tokenizer.encode
    assert len(encode("<think>")) == 1 and len(encode("</think>")) == 1


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_think_block_may_precede_the_calls(choice: str):
    grammar = with_reasoning(HERMES.grammar([ADD], choice), TAGS)
    assert takes(grammar, "<think>\nI add 2 and 3.\n</think>\n\n" + CALL)
    assert takes(grammar, "<think>\nnot </think yet, <think> again\n</think>\n\n" + CALL)
    assert takes(grammar, "<think>\n\n</think>\n\n" + CALL)
    assert takes(grammar, CALL)


def test_a_think_block_may_precede_an_answer_only_where_one_is_allowed():
    thought = "<think>\nplan\n</think>\n\nThe sum is 5."
    assert takes(with_reasoning(HERMES.grammar([ADD], "auto"), TAGS), thought)
    assert not takes(with_reasoning(HERMES.grammar([ADD], "required"), TAGS), thought)
    typed = with_reasoning(answer_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                                           "required": ["n"]}), TAGS)
    assert takes(typed, '<think>\nfive\n</think>\n\n{"n": 5}') and takes(typed, '{"n": 5}')


def test_every_format_with_a_think_block_compiles_on_the_qwen3_vocabulary():
    for fmt in (HERMES, LLAMA3_JSON, MISTRAL, PHI4_MINI):
        for choice in ("auto", "required", "add"):
            grammar = with_reasoning(fmt.grammar([ADD], choice), TAGS)
            calls = fmt.format_calls([_call()])
            assert takes(grammar, "<think>\nplan\n</think>\n\n" + calls), (fmt.name, choice)


def _call() -> ToolCall:
    return ToolCall(id="a1b2c3d4e", name="add", arguments={"a": 2, "b": 3})


async def test_a_forced_block_streams_apart_from_the_answer_on_the_real_engine():
    engine = qwen3()
    runtime = Runtime(engine)
    assert runtime.renderer.reasoning_tags == TAGS
    prompt = runtime.renderer.render([Message.user("What is 2 + 3?")], tools=[ADD]).token_ids
    forced = with_reasoning(HERMES.grammar([ADD], "required"), TAGS).replace("start: reasoning? ", "start: reasoning ")
    visible = VisibleTokens(MarkupFilter(HERMES.open_tag), ReasoningSplitter(TAGS))
    thoughts, texts = [], []
    session = await engine.open_session()
    try:
        constraint = engine.make_constraint(forced)
        async with session.stream(prompt, GenerationConfig(max_new_tokens=40), constraint) as stream:
            async for delta in stream:
                thought, text, _ = visible.step(delta)
                thoughts.append(thought)
                texts.append(text)
    finally:
        await session.close()
    thought, text, _ = visible.end()
    assert stream.result is not None and stream.result.text.startswith("<think>")
    reasoning, rest = split_reasoning(stream.result.text, TAGS)
    assert "".join([*thoughts, thought]) == reasoning and reasoning
    assert "<think>" not in "".join([*texts, text])
    assert HERMES.parse(rest).content == "".join([*texts, text]).strip()
