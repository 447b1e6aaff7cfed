"""Prompt-lookup drafts on the default model (``engine/decode/prompt_lookup.py``): under ``exact=True``
greedy decoding with drafts equals plain decoding token for token (tokens, stream, finish, KV log)
on a prompt that quotes a ~200-token document and on free text, in fewer model steps; the KV after
the call is that of a fresh prefill of its tokens; ``max_new_tokens`` and stop strings cut where
plain decoding does; under a grammar too. Seeded sampling draws the same tokens with drafts on or
off; a sampled call cancelled with a draft ahead leaves only its generated tokens in the KV; the
stateful engine (no per-position logits) decodes without drafts. Under the default numerics the
agreement is printed.

Each exact-numerics prompt is prefilled once; the runs on it fork that session (``TAIL``).

The unit tests (a fake model) are in ``tests/test_prompt_lookup.py`` and
``tests/test_speculative_sampling.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import numpy as np
import pytest

from agentkv.chat.toolcalls import tool_call_grammar
from agentkv.engine.base import Engine, GenerationConfig, KVSession
from agentkv.engine.generation import GenerationResult
from _sessions import one_pass_logits

pytestmark = pytest.mark.model

DOC = ("Incident 4471, checkout service. At 02:14 UTC the payment gateway began returning HTTP 503 for about 30 "
       "percent of requests. The on-call engineer, Priya Natarajan, paged the payments team at 02:19. The root "
       "cause was a connection pool limit of 64 on the gateway client, set in release 2.31.0, which was too low "
       "for the overnight batch of subscription renewals. The limit was raised to 256 at 02:41 and the error rate "
       "returned to normal by 02:47. Follow-up actions: add an alert on pool saturation above 80 percent, load "
       "test the renewal batch before each release, and document the pool settings in the runbook.")
ON, OFF = GenerationConfig(max_new_tokens=96), GenerationConfig(max_new_tokens=96, prompt_lookup=False)
SHORT = {"max_new_tokens": 48}
"""Enough for a quote to run on drafts for most of its tokens (the quote: 5 model steps for 48 tokens)."""


def quote_prompt(engine) -> list[int]:
    """A search tool's document in the conversation, then a request to repeat part of it."""
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Find the incident report."},
                {"role": "assistant", "content": "The search tool returned this document:\n\n" + DOC},
                {"role": "user", "content": "Quote the root cause and the follow-up actions exactly as written."}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def chat_prompt(engine) -> list[int]:
    messages = [{"role": "user", "content": "How does a bicycle's gear system make climbing hills easier?"}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


TAIL = 2
"""Prompt tokens each run prefills itself. The rest of a prompt is prefilled once, in a session the
runs fork (a fork holds the same KV: on the paged engine the same blocks, copied on write), so the
ON and OFF runs start from the same KV without prefilling the prompt each time (~1 CPU-s for the
quote on one core, 17 times). NOTE: two, not one: on the paged engine a multi-token chunk equals a
one-pass prefill exactly (f32) where a single-token step does not, so a run decodes from the KV
and logits a fresh session's one-pass prefill would give."""


async def hold_prompt(engine: Engine, ids: list[int]) -> KVSession:
    """A session holding ``ids`` but its last ``TAIL`` tokens, for ``run`` to fork."""
    base = await engine.open_session()
    await base.prefill(ids[:-TAIL])
    return base


@pytest.fixture(scope="module")
async def held_quote(paged_exact) -> AsyncIterator[KVSession]:
    """A ``hold_prompt`` session of ``paged_exact`` on ``quote_prompt``, opened once for the module."""
    base = await hold_prompt(paged_exact, quote_prompt(paged_exact))
    yield base
    await base.close()


async def run(engine, ids: list[int], config: GenerationConfig, grammar: str | None = None,
              base: KVSession | None = None) -> tuple[GenerationResult, list[int], str, tuple[int, ...], np.ndarray]:
    """One call on a fresh session, or on a fork of ``base`` (``hold_prompt`` of ``ids``): the
    result, the streamed ids and text, the KV log after it and the next-token logits of that KV."""
    session = await base.fork() if base is not None else await engine.open_session()
    try:
        constraint = engine.make_constraint(grammar) if grammar is not None else None
        stream = session.stream(ids, config, constraint=constraint)
        deltas = [delta async for delta in stream]
        assert stream.result is not None
        logits = await session.next_token_logits()
        return stream.result, [d.token_id for d in deltas], "".join(d.text for d in deltas), session.tokens, logits
    finally:
        await session.close()


@pytest.mark.parametrize("prompt", [quote_prompt, chat_prompt], ids=["quote", "free text"])
async def test_drafts_equal_plain_greedy_decoding_under_exact_numerics_in_fewer_steps(paged_exact, held_quote,
                                                                                      prompt):
    ids = prompt(paged_exact)
    base = held_quote if prompt is quote_prompt else None  # the free-text prompt is a short one
    plain, plain_ids, plain_text, plain_log, _ = await run(paged_exact, ids, OFF.model_copy(update=SHORT), base=base)
    fast, fast_ids, fast_text, fast_log, fast_logits = await run(paged_exact, ids, ON.model_copy(update=SHORT),
                                                                 base=base)
    assert fast.token_ids == plain.token_ids, (fast.text, plain.text)
    assert fast.text == plain.text == fast_text == plain_text and fast.finish_reason == plain.finish_reason
    assert fast_ids == plain_ids == list(fast.token_ids[:len(fast_ids)])  # a delta per token (EOS has none)
    assert fast_log == plain_log  # the KV log holds the same tokens
    reference = await one_pass_logits(paged_exact, fast_log)
    assert np.abs(fast_logits - reference).max() <= 1e-3  # and the KV of those tokens
    m, p = fast.metrics, plain.metrics
    assert p.drafted_tokens == p.accepted_tokens == 0 and 0 <= m.accepted_tokens <= m.drafted_tokens
    assert m.model_steps <= p.model_steps - m.accepted_tokens + 1
    assert m.model_steps == p.model_steps - m.steps_saved and p.steps_saved == 0  # saved: confirmed drafts
    if prompt is quote_prompt:
        assert m.accepted_tokens >= m.generated_tokens // 3 and m.model_steps < p.model_steps
    print(f"\n[prompt lookup] {prompt.__name__}: {m.generated_tokens} tokens, {m.drafted_tokens} drafted, "
          f"{m.accepted_tokens} accepted, steps {p.model_steps} -> {m.model_steps}")


async def test_sessions_quoting_at_once_verify_their_drafts_in_shared_steps_and_answer_as_alone(paged_exact,
                                                                                                held_quote):
    # issue 47, item 6: before, a draft rode in a shared step only on the 5 % credit kept for plain
    # sessions, so two sessions quoting at once almost never drafted
    ids = quote_prompt(paged_exact)
    alone, *_ = await run(paged_exact, ids, ON.model_copy(update=SHORT), base=held_quote)
    before = paged_exact.batcher.stats()
    together: list[GenerationResult] = []

    async def one() -> None:
        together.append((await run(paged_exact, ids, ON.model_copy(update=SHORT), base=held_quote))[0])

    async with anyio.create_task_group() as tasks:
        for _ in range(2):
            tasks.start_soon(one)
    after = paged_exact.batcher.stats()
    for result in together:
        assert result.token_ids == alone.token_ids  # drafts verified in a shared step change nothing
        m = result.metrics
        assert m.accepted_tokens >= m.generated_tokens // 3 and m.model_steps < m.generated_tokens // 2
    assert after.sequences - before.sequences > after.steps - before.steps  # the two did share steps


@pytest.mark.parametrize("cut", ["max_new_tokens=1", "max_new_tokens=7", "max_new_tokens=40", "stop string"])
async def test_max_new_tokens_and_stop_strings_cut_where_plain_decoding_does(paged_exact, held_quote, cut):
    ids = quote_prompt(paged_exact)
    if cut == "stop string":
        whole, *_ = await run(paged_exact, ids, OFF.model_copy(update={"max_new_tokens": 24}), base=held_quote)
        assert len(whole.text) > 47
        update: dict[str, object] = {"stop_strings": (whole.text[40:47],)}  # inside a quoted run
    else:
        update = {"max_new_tokens": int(cut.split("=")[1])}
    plain, _, _, plain_log, _ = await run(paged_exact, ids, OFF.model_copy(update=update), base=held_quote)
    fast, _, _, fast_log, _ = await run(paged_exact, ids, ON.model_copy(update=update), base=held_quote)
    assert (fast.token_ids, fast.text, fast.finish_reason) == (plain.token_ids, plain.text, plain.finish_reason)
    assert fast_log == plain_log and len(fast_log) == len(ids) + max(0, len(fast.token_ids) - 1)


async def test_drafts_under_a_grammar_equal_plain_decoding_under_exact_numerics(paged_exact):
    """Two tool calls of the function-calling set, each to its end: ``parallel_0`` (two calls of one
    tool in one answer: drafts from the question and from the first call) and ``nested_0`` (a nested
    object argument). A single call of one tool (``simple_0``) is the first half of ``parallel_0``."""
    cases_path = Path(__file__).resolve().parents[1] / "data" / "function_calling.json"
    cases = json.loads(cases_path.read_text(encoding="utf-8"))
    drafted = 0
    for case_id in ["parallel_0", "nested_0"]:
        case = next(c for c in cases["cases"] if c["id"] == case_id)
        tools = [cases["tools"][name] for name in case["tools"]]
        text = paged_exact.tokenizer.apply_chat_template([{"role": "user", "content": case["question"]}],
                                                         add_generation_prompt=True, tools=tools)
        ids, grammar = paged_exact.tokenizer.encode(text), tool_call_grammar(tools, "required")
        both_off = OFF.model_copy(update={"fast_forward": False})
        base = await hold_prompt(paged_exact, ids)
        try:
            plain, _, _, plain_log, _ = await run(paged_exact, ids, both_off, grammar, base=base)
            fast, _, _, fast_log, _ = await run(paged_exact, ids, ON, grammar, base=base)
        finally:
            await base.close()
        assert (fast.token_ids, fast.finish_reason) == (plain.token_ids, plain.finish_reason), case_id
        assert fast_log == plain_log
        drafted += fast.metrics.drafted_tokens
    assert drafted > 0


async def test_seeded_sampling_draws_the_same_tokens_with_drafts_and_the_stateful_engine_does_not_draft(
        paged_exact, held_quote, engine_f32):
    ids = quote_prompt(paged_exact)
    for seed in (3, 4):
        sampled = {"temperature": 0.7, "top_p": 0.9, "seed": seed, "max_new_tokens": 24}
        on, _, _, on_log, _ = await run(paged_exact, ids, ON.model_copy(update=sampled), base=held_quote)
        off, _, _, off_log, _ = await run(paged_exact, ids, OFF.model_copy(update=sampled), base=held_quote)
        assert on.token_ids == off.token_ids and on_log == off_log, (on.text, off.text)
        assert on.metrics.accepted_tokens > 0 and off.metrics.drafted_tokens == 0
        assert on.metrics.model_steps == off.metrics.model_steps - on.metrics.steps_saved
    stateful, *_ = await run(engine_f32, quote_prompt(engine_f32), ON.model_copy(update={"max_new_tokens": 8}))
    assert stateful.metrics.drafted_tokens == 0 and stateful.metrics.generated_tokens > 0


async def test_a_sampled_call_cancelled_with_a_draft_ahead_keeps_only_its_tokens_in_the_kv(paged_exact, held_quote):
    ids = quote_prompt(paged_exact)
    config = ON.model_copy(update={"temperature": 0.7, "top_p": 0.9, "seed": 5, "max_new_tokens": 24})
    whole, *_ = await run(paged_exact, ids, config, base=held_quote)
    session = await held_quote.fork()
    try:
        taken: list[int] = []
        with anyio.CancelScope() as scope:
            async for delta in session.stream(ids, config):
                taken.append(delta.token_id)
                if len(taken) == 12:
                    scope.cancel()  # delivered at the next feed or trim; drafts may run ahead till then
        generated = list(session.tokens[len(ids):])
        assert session.tokens[:len(ids)] == tuple(ids) and len(generated) <= len(taken)
        assert generated == list(whole.token_ids[:len(generated)])  # no drafted token past the chosen ones
        logits = await session.next_token_logits()
    finally:
        await session.close()
    reference = await one_pass_logits(paged_exact, tuple(ids) + tuple(generated))
    assert np.abs(logits - reference).max() <= 1e-3


async def test_default_numerics_quote_with_drafts_and_report_agreement(engine):
    ids = quote_prompt(engine)
    plain, *_ = await run(engine, ids, OFF.model_copy(update=SHORT))
    fast, *_ = await run(engine, ids, ON.model_copy(update=SHORT))
    if fast.metrics.model_steps:  # the paged engine drafts; the stateful one cannot
        assert fast.metrics.accepted_tokens > 0
    same = next((i for i, (a, b) in enumerate(zip(fast.token_ids, plain.token_ids)) if a != b), len(fast.token_ids))
    print(f"\n[prompt lookup] default numerics: first {same} of {len(plain.token_ids)} tokens equal to plain "
          f"decoding; {fast.metrics.accepted_tokens}/{fast.metrics.drafted_tokens} drafted tokens accepted")
