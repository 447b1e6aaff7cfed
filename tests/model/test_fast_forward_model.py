"""Grammar fast-forward on the default model (``engine/decode/fast_forward.py``): tool calls under
``tool_choice="required"`` decoded with fast-forward on equal the one-step-per-token decode under
``exact=True`` (tokens, stream, KV log) in fewer model steps; seeded sampling draws the same tokens;
``max_new_tokens`` and stop strings cut a forced run where one-by-one decoding would. Under the
default numerics every answer decoded with fast-forward is a valid call (how many equal the
one-by-one answers there, and the speed-up, is ``benchmarks/decode.py``'s tool-call workload).

Each case's long tool prompt is prefilled once; its ON and OFF runs fork that session (``TAIL``).

The unit tests (fake constraints, real llguidance masks) are in ``tests/test_fast_forward.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from agentkv.chat.toolcalls import parse_tool_calls, tool_call_grammar
from agentkv.engine.base import Engine, GenerationConfig, KVSession
from agentkv.engine.generation import GenerationResult

pytestmark = pytest.mark.model

CASES = json.loads((Path(__file__).resolve().parents[1] / "data" / "function_calling.json").read_text(encoding="utf-8"))
PICKED = ["simple_0", "multiple_0", "parallel_0", "nested_0", "enum_0", "parallel_multiple_0"]
"""The first case of each category: the valid-call test under the default numerics runs them all."""
EXACT = ["multiple_0", "nested_0", "enum_0"]
"""The exactness test's cases, each a different shape of forced run under the one-call grammar: a
choice among four tool names (the model picks the name, the rest of it and the keys are forced), a
nested object with an integer and an enum (``cabin``), and enums whose values share a prefix
(``m``, ``mi``: a forced run must stop where the value is still open). The one-tool case
(``simple_0``: name and keys forced, strings written by the model) is checked on the paged engine
by the cut test; the parallel categories' prompts under the one-call grammar give these shapes
again."""
# NOTE: drafts off on both sides: model_steps here counts fast-forward alone
ON = GenerationConfig(max_new_tokens=96, prompt_lookup=False)
OFF = GenerationConfig(max_new_tokens=96, fast_forward=False, prompt_lookup=False)


def case_prompt(engine, case_id: str) -> tuple[list[int], str]:
    """The case's question rendered with its tools, and the ``required`` single-call grammar."""
    case = next(c for c in CASES["cases"] if c["id"] == case_id)
    tools = [CASES["tools"][name] for name in case["tools"]]
    text = engine.tokenizer.apply_chat_template([{"role": "user", "content": case["question"]}],
                                                add_generation_prompt=True, tools=tools)
    return engine.tokenizer.encode(text), tool_call_grammar(tools, "required", parallel=False)


TAIL = 2
"""Prompt tokens each run prefills itself. The rest of the prompt is prefilled once, in a session
every run forks (a fork holds the same KV: on the paged engine the same blocks, copied on write),
so the ON and OFF runs of a case start from the same KV without prefilling the long tool prompt
twice. NOTE: two, not one: on the paged engine a multi-token chunk equals a one-pass prefill
exactly (f32) where a single-token step does not, so a run decodes from the KV and logits a fresh
session's one-pass prefill would give."""


async def hold_prompt(engine: Engine, ids: list[int]) -> KVSession:
    """A session holding ``ids`` but its last ``TAIL`` tokens, for ``run`` to fork."""
    base = await engine.open_session()
    await base.prefill(ids[:-TAIL])
    return base


async def run(engine: Engine, base: KVSession, ids: list[int], grammar: str, config: GenerationConfig
              ) -> tuple[GenerationResult, list[int], str, tuple[int, ...]]:
    """One call on a fork of ``base`` (``hold_prompt``): the result, the streamed ids and text,
    the KV log after it."""
    session = await base.fork()
    try:
        stream = session.stream(ids, config, constraint=engine.make_constraint(grammar))
        deltas = [delta async for delta in stream]
        assert stream.result is not None
        return stream.result, [d.token_id for d in deltas], "".join(d.text for d in deltas), session.tokens
    finally:
        await session.close()


@pytest.fixture(scope="module")
async def held_on_paged_exact(paged_exact: Engine) -> AsyncIterator[Callable[[str], Awaitable[KVSession]]]:
    """``await held("simple_0")``: a ``hold_prompt`` session of ``paged_exact`` per case, opened
    once for the module (the parametrized cut test runs one case four times)."""
    bases: dict[str, KVSession] = {}

    async def held(case_id: str) -> KVSession:
        if case_id not in bases:
            bases[case_id] = await hold_prompt(paged_exact, case_prompt(paged_exact, case_id)[0])
        return bases[case_id]

    yield held
    for base in bases.values():
        await base.close()


async def test_fast_forward_equals_one_step_per_token_under_exact_numerics_in_fewer_steps(any_exact_engine):
    forced = saved = 0
    for case_id in EXACT:
        ids, grammar = case_prompt(any_exact_engine, case_id)
        base = await hold_prompt(any_exact_engine, ids)
        try:
            plain, plain_ids, plain_text, plain_log = await run(any_exact_engine, base, ids, grammar, OFF)
            fast, fast_ids, fast_text, fast_log = await run(any_exact_engine, base, ids, grammar, ON)
        finally:
            await base.close()
        assert fast.token_ids == plain.token_ids, (case_id, fast.text, plain.text)
        assert fast.text == plain.text == fast_text == plain_text and fast.finish_reason == plain.finish_reason
        assert fast_ids == plain_ids == list(fast.token_ids)  # one delta per token, in order
        assert fast_log == plain_log  # the KV log holds the same tokens
        m, p = fast.metrics, plain.metrics
        assert p.forced_tokens == p.steps_saved == 0
        assert 0 < m.steps_saved <= m.forced_tokens < m.generated_tokens
        if p.model_steps:  # the paged engine counts its steps (the stateful one reports 0)
            assert m.model_steps == p.model_steps - m.steps_saved
        forced, saved = forced + m.forced_tokens, saved + m.steps_saved
        print(f"\n[fast-forward] {case_id}: {m.generated_tokens} tokens, {m.forced_tokens} forced, "
              f"steps {p.model_steps} -> {m.model_steps}")
    print(f"[fast-forward] {forced} forced tokens, {saved} steps saved over {len(EXACT)} calls")


async def test_seeded_sampling_draws_the_same_tokens_with_fast_forward_on_or_off(paged_exact, held_on_paged_exact):
    """Two seeds on the longest case (~70 tokens, sampled choices between forced runs)."""
    ids, grammar = case_prompt(paged_exact, "nested_0")
    base = await held_on_paged_exact("nested_0")
    for seed in (1, 2):
        sampled = {"temperature": 0.9, "top_p": 0.95, "seed": seed}
        plain, *_ = await run(paged_exact, base, ids, grammar, OFF.model_copy(update=sampled))
        fast, *_ = await run(paged_exact, base, ids, grammar, ON.model_copy(update=sampled))
        assert fast.token_ids == plain.token_ids and fast.metrics.forced_tokens > 0


@pytest.mark.parametrize("cut", [{"max_new_tokens": 3}, {"max_new_tokens": 12}, {"stop_strings": ('": "',)},
                                 {"stop_strings": ("}}",)}])
async def test_max_new_tokens_and_stop_strings_cut_a_forced_run_where_one_by_one_decoding_does(
        paged_exact, held_on_paged_exact, cut):
    ids, grammar = case_prompt(paged_exact, "simple_0")
    base = await held_on_paged_exact("simple_0")
    plain, _, _, plain_log = await run(paged_exact, base, ids, grammar, OFF.model_copy(update=cut))
    fast, _, _, fast_log = await run(paged_exact, base, ids, grammar, ON.model_copy(update=cut))
    assert (fast.token_ids, fast.text, fast.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert fast_log == plain_log and len(fast.token_ids) <= cut.get("max_new_tokens", 96)


async def test_default_numerics_give_valid_calls_with_fast_forward(engine):
    """Every category's first case, fast-forward on (the default). Agreement with one-by-one
    decoding under these numerics is measured, not asserted: ``benchmarks/decode.py``
    (``equal_answers_toolcalls``)."""
    for case_id in PICKED:
        ids, grammar = case_prompt(engine, case_id)
        base = await hold_prompt(engine, ids)
        try:
            fast, *_ = await run(engine, base, ids, grammar, ON)
        finally:
            await base.close()
        parsed = parse_tool_calls(fast.text)
        assert parsed.errors == () and len(parsed.tool_calls) == 1, fast.text
        assert fast.metrics.forced_tokens > 0
