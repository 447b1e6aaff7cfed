"""KVSession on the real model, on both engines (stateful and paged): multi-turn reuse,
concurrency, cancellation, streaming, errors."""

from __future__ import annotations

import anyio
import pydantic
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.errors import ContextOverflowError, KVSessionClosed, UserError

pytestmark = pytest.mark.model

GREEDY = GenerationConfig(max_new_tokens=24)


async def test_ten_turn_chat_prefills_only_the_new_tokens_each_turn(any_engine):
    tok = any_engine.tokenizer
    session = await any_engine.open_session()
    messages = [{"role": "system", "content": "You are a terse assistant."}]
    for turn in range(10):
        messages.append({"role": "user", "content": f"Question {turn}: name a colour and a number."})
        prompt = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
        before = len(session.tokens)
        result = await session.generate(prompt, GenerationConfig(max_new_tokens=16))
        m = result.metrics
        assert m.prompt_tokens == len(prompt)
        if turn > 0:
            # Everything the session had already read is reused, assistant turns included:
            # the generated ids stay in the log, so the re-rendered history matches them.
            assert m.reused_tokens == before
            assert m.prefilled_tokens == len(prompt) - before
        # Render the assistant turn from the generated ids, as the runner does.
        messages.append({"role": "assistant", "content": tok.decode(result.token_ids).removesuffix("<|im_end|>")})
    await session.close()


async def test_generated_ids_survive_when_retokenising_the_text_would_change_them(any_engine, chat_ids):
    session = await any_engine.open_session()
    prompt = chat_ids("Say something.")
    result = await session.generate(prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True))
    # The log holds the generated ids verbatim (all but the last, which was never fed).
    assert session.tokens == tuple(prompt) + result.token_ids[:-1]
    follow = list(prompt) + list(result.token_ids) + any_engine.tokenizer.encode("\n<|im_start|>user\nmore")
    again = await session.generate(follow, GenerationConfig(max_new_tokens=4))
    assert again.metrics.reused_tokens == len(prompt) + len(result.token_ids) - 1
    await session.close()


@pytest.fixture(params=["stateful", "paged-exact"])
def concurrent_engine(request: pytest.FixtureRequest):
    """Sessions on the stateful engine run side by side in their own slots, with the default
    numerics; on the paged engine they share batched steps, which agree bit for bit with solo
    steps only under exact numerics (default numerics: up to ~0.6 max abs logit apart, and the
    batch a token lands in depends on timing — see tests/test_paged_batching.py)."""
    return request.getfixturevalue("stateful_engine" if request.param == "stateful" else "paged_exact")


async def test_four_concurrent_sessions_match_their_solo_greedy_runs(concurrent_engine, chat_ids):
    any_engine = concurrent_engine
    prompts = [chat_ids(q) for q in ("Name a bird.", "Count to five.", "What is rain?", "Say hello in French.")]
    solo = []
    for prompt in prompts:
        s = await any_engine.open_session()
        solo.append((await s.generate(prompt, GREEDY)).token_ids)
        await s.close()
    results: list[tuple[int, ...] | None] = [None] * 4
    sessions = [await any_engine.open_session() for _ in prompts]

    async def run(i: int) -> None:
        results[i] = (await sessions[i].generate(prompts[i], GREEDY)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(run, i)
    assert results == solo
    for s in sessions:
        await s.close()


async def test_stream_yields_text_that_joins_into_the_result(any_engine, chat_ids):
    session = await any_engine.open_session()
    stream = session.stream(chat_ids("Tell me about cats."), GREEDY)
    pieces = [delta.text async for delta in stream]
    assert stream.result is not None
    assert "".join(pieces) == stream.result.text
    assert len(pieces) >= 1
    await session.close()


async def test_streamed_text_never_contains_broken_utf8(any_engine, chat_ids):
    session = await any_engine.open_session()
    prompt = chat_ids("Reply with three emoji and the word café: ")
    stream = session.stream(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    async for delta in stream:
        assert "\ufffd" not in delta.text
    assert stream.result.text == any_engine.tokenizer.decode(stream.result.token_ids)
    await session.close()


async def test_stop_string_ends_generation_and_is_cut_from_text(any_engine, chat_ids):
    session = await any_engine.open_session()
    prompt = chat_ids("Describe the sea in two sentences.")
    free = await session.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True))
    words = free.text.split()
    stop = words[len(words) // 2]  # a word from the middle of the greedy answer
    await session.trim(0)
    cut = await session.generate(prompt, GenerationConfig(max_new_tokens=40, ignore_eos=True, stop_strings=(stop,)))
    assert cut.finish_reason == "stop"
    assert cut.text == free.text[: free.text.index(stop)]
    await session.close()


async def test_cancelling_mid_decode_leaves_tokens_and_kv_consistent(any_exact_engine, chat_ids):
    session = await any_exact_engine.open_session()
    prompt = chat_ids("Write a long story about a dragon.")
    seen = 0
    with anyio.move_on_after(30):
        async with anyio.create_task_group() as tg:

            async def consume() -> None:
                nonlocal seen
                async for _ in session.stream(prompt, GenerationConfig(max_new_tokens=200, ignore_eos=True)):
                    seen += 1
                    if seen == 10:
                        tg.cancel_scope.cancel()

            tg.start_soon(consume)
    assert seen == 10
    assert len(session.tokens) >= len(prompt)
    assert session.tokens[: len(prompt)] == tuple(prompt)
    logits = await session.next_token_logits()
    fresh = await any_exact_engine.open_session()
    await fresh.prefill(session.tokens)
    reference = await fresh.next_token_logits()
    assert abs(logits - reference).max() <= 1e-3
    # and the session keeps working from where it was, without re-reading anything
    before = len(session.tokens)
    result = await session.generate(list(session.tokens), GenerationConfig(max_new_tokens=4))
    assert result.metrics.reused_tokens == before
    assert result.metrics.prefilled_tokens == 0
    await session.close()
    await fresh.close()


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": -0.1},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"top_k": -1},
        {"min_p": 2.0},
        {"num_beams": 0},
        {"max_new_tokens": -1},
        {"repetition_penalty": 0.0},
        {"num_beams": 2, "num_return_sequences": 3},
        {"num_beams": 2, "temperature": 0.7},
        {"unknown_knob": 1},
    ],
)
def test_invalid_generation_config_is_rejected(bad):
    with pytest.raises(pydantic.ValidationError):
        GenerationConfig(**bad)


async def test_prompt_longer_than_the_context_raises_context_overflow(any_engine):
    session = await any_engine.open_session()
    with pytest.raises(ContextOverflowError) as info:
        session.stream([13] * (any_engine.max_context_len + 1), GREEDY)
    assert info.value.limit == any_engine.max_context_len
    assert session.tokens == ()
    await session.close()


async def test_empty_prompt_and_closed_session_raise_named_errors(any_engine):
    session = await any_engine.open_session()
    with pytest.raises(UserError):
        await session.generate([], GREEDY)
    await session.close()
    await session.close()  # idempotent
    with pytest.raises(KVSessionClosed):
        await session.generate([1, 2, 3], GREEDY)
