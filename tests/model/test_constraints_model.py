"""Tests of agentkv.engine.decode.constraints: llguidance masks from the GGUF vocabulary, and
grammar-constrained tool calls on the real model (marked ``model``).

The tests here run the real model; the scripted ones are in ``tests/test_constraints.py``."""

from __future__ import annotations

import json
import time

import numpy as np
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
from agentkv.engine.decode.constraints import (
    ConstraintFactory,
    GrammarConstraint,
)
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


PROMPTS = [
    "What is 17 * 23?",
    "What time is it in Tokyo?",
    "Compute the square root of 2.",
    "What's the date today?",
    "How much is 1234 + 5678?",
    "Tell me the current time in Paris.",
    "Divide 100 by 7.",
    "What is 2 to the power of 10?",
    "I need the time in New York right now.",
    "Calculate 15% of 80.",
    "what's 9 minus 12",
    "Is it morning in London now?",
    "Evaluate sin(pi / 4) * sqrt(2).",
    "How many seconds are in a day?",
    "Which day of the week is it in UTC?",
    "Add 0.1 and 0.2.",
    "What is the cube of 7?",
    "Give me the current UTC time.",
    "How much is 3 dozen eggs if one egg costs 0.25?",
    "Hello! Can you tell me the time in Sydney, Australia?",
]


class TimedConstraint:
    """Wraps a constraint and adds up the seconds spent in allowed_mask + advance."""

    def __init__(self, inner: GrammarConstraint) -> None:
        self.inner = inner
        self.seconds = 0.0
        self.steps = 0

    def allowed_mask(self) -> np.ndarray:
        started = time.perf_counter()
        mask = self.inner.allowed_mask()
        self.seconds += time.perf_counter() - started
        self.steps += 1
        return mask

    def advance(self, token_id: int) -> None:
        started = time.perf_counter()
        self.inner.advance(token_id)
        self.seconds += time.perf_counter() - started

    def is_finished(self) -> bool:
        return self.inner.is_finished()


@pytest.fixture(scope="session")
def constraint_engine():
    """The default model with one slot, for the constrained-decoding tests."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=1)


@pytest.fixture(scope="module")
def model_factory(constraint_engine) -> ConstraintFactory:
    meta = constraint_engine.files.gguf_metadata()
    return ConstraintFactory(
        meta["tokenizer.ggml.tokens"],
        eos_token_id=sorted(constraint_engine.eos_token_ids),
        vocab_size=VOCAB,
        token_types=meta["tokenizer.ggml.token_type"],
        encode=constraint_engine.tokenizer.encode,
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


async def test_required_tool_choice_always_yields_one_valid_call_and_the_mask_overhead_is_small(
    constraint_engine, model_factory
):
    session = await constraint_engine.open_session()
    grammar = tool_call_grammar(TOOLS, "required", parallel=False)
    timed_seconds, timed_steps, decode_seconds = 0.0, 0, 0.0
    names = []
    for question in PROMPTS:
        timed = TimedConstraint(model_factory(grammar))
        ids = prompt_ids(constraint_engine, question)
        result = await session.generate(ids, CONSTRAINED, constraint=timed)
        assert result.finish_reason in ("constraint", "stop"), result.text
        names.append(assert_one_valid_call(result.text, {"calculator", "clock"}).name)
        timed_seconds, timed_steps = timed_seconds + timed.seconds, timed_steps + timed.steps
        decode_seconds += result.metrics.tpot_s * (result.metrics.generated_tokens - 1)
    plain_config = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    plain_tpots = [
        (await session.generate(prompt_ids(constraint_engine, question), plain_config)).metrics.tpot_s
        for question in PROMPTS[:3]
    ]
    await session.close()
    overhead_ms = 1e3 * timed_seconds / timed_steps
    step_ms = 1e3 * sorted(plain_tpots)[1]  # median of three unconstrained runs
    constrained_step_ms = 1e3 * decode_seconds / (timed_steps - len(PROMPTS))
    print(
        f"\n[constraints] {len(PROMPTS)}/{len(PROMPTS)} valid calls ({names.count('clock')} clock); "
        f"mask+advance {overhead_ms:.3f} ms/token over {timed_steps} tokens; plain step {step_ms:.2f} ms; "
        f"constrained step {constrained_step_ms:.2f} ms ({100 * overhead_ms / step_ms:.1f}% of a plain step)"
    )
    assert overhead_ms < step_ms


async def test_named_tool_choice_calls_that_tool(constraint_engine, model_factory):
    session = await constraint_engine.open_session()
    grammar = tool_call_grammar(TOOLS, "clock", parallel=False)
    for question in PROMPTS[:4]:
        result = await session.generate(
            prompt_ids(constraint_engine, question), CONSTRAINED, constraint=model_factory(grammar)
        )
        assert_one_valid_call(result.text, {"clock"})
    await session.close()


async def test_with_parallel_calls_every_call_of_an_answer_is_valid(constraint_engine, model_factory):
    session = await constraint_engine.open_session()
    grammar = tool_call_grammar(TOOLS, "required")  # parallel: one or more calls
    for question in PROMPTS[:4]:
        result = await session.generate(
            prompt_ids(constraint_engine, question), CONSTRAINED, constraint=model_factory(grammar)
        )
        parsed = parse_tool_calls(result.text)
        assert parsed.errors == () and parsed.content == "" and parsed.tool_calls, result.text
        for call in parsed.tool_calls:
            BY_NAME[call.name].validate_arguments(call.arguments)
    await session.close()


async def test_auto_tool_choice_yields_prose_without_a_call_tag_or_one_valid_call(
    constraint_engine, model_factory
):
    session = await constraint_engine.open_session()
    grammar = tool_call_grammar(TOOLS, "auto")
    for question in PROMPTS[:4]:
        result = await session.generate(
            prompt_ids(constraint_engine, question), CONSTRAINED, constraint=model_factory(grammar)
        )
        if result.text.startswith(TOOL_CALL_OPEN):
            assert_one_valid_call(result.text, {"calculator", "clock"})
        else:
            assert TOOL_CALL_OPEN not in result.text and result.text.strip()
    await session.close()
