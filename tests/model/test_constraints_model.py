"""Tests of agentkv.engine.decode.constraints: llguidance masks from the GGUF vocabulary, and
grammar-constrained tool calls on the real model (marked ``model``).

The tests here run the real model; the scripted ones are in ``tests/test_constraints.py``."""

from __future__ import annotations

import json

import pytest
from test_constraints import TOOLS, VOCAB
from test_constraints import tokenizer  # noqa: F401  (a fixture)

from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import (
    TOOL_CALL_OPEN,
    format_tool_calls,
    parse_tool_calls,
    tool_call_grammar,
)
from agentkv.engine.base import GenerationConfig
from agentkv.engine.decode.constraints import ConstraintFactory
from agentkv.tools import calculator, clock

pytestmark = pytest.mark.model


BY_NAME = {"calculator": calculator, "clock": clock}


SYSTEM = (
    "You are an assistant that answers by calling tools. Available tools:\n"
    + "\n".join(json.dumps(tool["function"]) for tool in TOOLS)
    + "\nTo call a tool, write:\n"
    + format_tool_calls([ToolCall(name="calculator", arguments={"expression": "3 * 7"})])
)


CONSTRAINED = GenerationConfig(max_new_tokens=256)


AUTO = GenerationConfig(max_new_tokens=64)
"""Under ``auto`` the grammar lets the first token choose prose or a call; prose answers run on
(the default model repeats itself to any limit) under the same no-tag rule at every token, and one
call takes ~30 tokens: 64 covers a whole call and the prose branch."""


PROMPTS = [
    "What is 17 * 23?",
    "What time is it in Tokyo?",
    "what's 9 minus 12",
    "Is it morning in London now?",
    "How much is 3 dozen eggs if one egg costs 0.25?",
    "Hello! Can you tell me the time in Sydney, Australia?",
]
"""Both tools, each asked plainly and indirectly (a lower-case fragment, a word problem, a
question whose tool is implied, a greeting before the question). Under the grammar a valid call
is a per-answer property: these six run every path a longer list would (the call's opening, each
tool's argument schema, the close that ends decoding)."""


@pytest.fixture(scope="module")
def model_factory(engine) -> ConstraintFactory:
    """A constraint factory built here from the default model's GGUF vocabulary (what this file
    tests), on the suite's shared default engine."""
    meta = engine.files.gguf_metadata()
    return ConstraintFactory(
        meta["tokenizer.ggml.tokens"],
        eos_token_id=sorted(engine.eos_token_ids),
        vocab_size=VOCAB,
        token_types=meta["tokenizer.ggml.token_type"],
        encode=engine.tokenizer.encode,
    )


def prompt_ids(engine, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def assert_one_valid_call(text: str, allowed: set[str]) -> ToolCall:
    parsed = parse_tool_calls(text)
    assert parsed.errors == () and len(parsed.tool_calls) == 1 and parsed.content == "", text
    call = parsed.tool_calls[0]
    assert call.name in allowed
    BY_NAME[call.name].validate_arguments(call.arguments)  # pydantic: raises if invalid
    return call


async def test_required_tool_choice_always_yields_one_valid_call(engine, model_factory):
    """Each prompt of ``PROMPTS`` ends in exactly one call that validates. What the mask costs a
    token is measured by ``benchmarks/decode.py`` (``mask_ms_per_token_toolcalls``), not here."""
    session = await engine.open_session()
    grammar = tool_call_grammar(TOOLS, "required", parallel=False)
    names = []
    try:
        for question in PROMPTS:
            result = await session.generate(prompt_ids(engine, question), CONSTRAINED,
                                            constraint=model_factory(grammar))
            assert result.finish_reason in ("constraint", "stop"), result.text
            names.append(assert_one_valid_call(result.text, {"calculator", "clock"}).name)
    finally:
        await session.close()
    print(f"\n[constraints] {len(PROMPTS)}/{len(PROMPTS)} valid calls ({names.count('clock')} clock)")


async def test_named_tool_choice_calls_that_tool(engine, model_factory):
    """A calculator question and a clock one: the named tool is called either way."""
    session = await engine.open_session()
    grammar = tool_call_grammar(TOOLS, "clock", parallel=False)
    for question in PROMPTS[:2]:
        result = await session.generate(
            prompt_ids(engine, question), CONSTRAINED, constraint=model_factory(grammar)
        )
        assert_one_valid_call(result.text, {"clock"})
    await session.close()


async def test_with_parallel_calls_every_call_of_an_answer_is_valid(engine, model_factory):
    """A calculator question and a clock one; each answer holds several calls (~120 tokens)."""
    session = await engine.open_session()
    grammar = tool_call_grammar(TOOLS, "required")  # parallel: one or more calls
    for question in PROMPTS[:2]:
        result = await session.generate(
            prompt_ids(engine, question), CONSTRAINED, constraint=model_factory(grammar)
        )
        parsed = parse_tool_calls(result.text)
        assert parsed.errors == () and parsed.content == "" and parsed.tool_calls, result.text
        for call in parsed.tool_calls:
            BY_NAME[call.name].validate_arguments(call.arguments)
    await session.close()


async def test_auto_tool_choice_yields_prose_without_a_call_tag_or_one_valid_call(
    engine, model_factory
):
    session = await engine.open_session()
    grammar = tool_call_grammar(TOOLS, "auto")
    for question in PROMPTS[:4]:
        result = await session.generate(
            prompt_ids(engine, question), AUTO, constraint=model_factory(grammar)
        )
        if result.text.startswith(TOOL_CALL_OPEN):
            assert_one_valid_call(result.text, {"calculator", "clock"})
        else:
            assert TOOL_CALL_OPEN not in result.text and result.text.strip()
    await session.close()
