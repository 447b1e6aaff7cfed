"""agentkv.testing: the scripted engine keeps the real session's protocol, accounting and errors."""

from __future__ import annotations

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.engine.base import Engine, GenerationConfig, KVSession
from agentkv.errors import UserError
from agentkv.testing import ScriptedCall, ScriptedEngine, ScriptedTokenizer
from agentkv.testing.fake_kv import KV_BYTES_PER_TOKEN

CFG = GenerationConfig(max_new_tokens=64)
TOOL_REPLY = '<tool_call>\n{"name": "calc", "arguments": {"expression": "1+1"}}\n</tool_call>'


def render(tok: ScriptedTokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def user_prompt(engine: ScriptedEngine, text: str = "hi") -> list[int]:
    return render(engine.tokenizer, [{"role": "user", "content": text}])


# ---- protocol and accounting -------------------------------------------------------------
async def test_engine_and_session_satisfy_the_runtime_checkable_protocols():
    engine = ScriptedEngine()
    session = await engine.open_session()
    assert isinstance(engine, Engine)
    assert isinstance(session, KVSession)
    assert engine.fingerprint == "scripted"
    assert engine.eos_token_ids == frozenset({engine.tokenizer.eos_token_id})
    assert engine.max_context_len == 8192


async def test_multi_turn_chat_reuses_the_whole_previous_log_and_prefills_only_new_tokens():
    script = [  # (scripted reply, the message that follows it)
        (TOOL_REPLY, {"role": "tool", "content": "2"}),
        ("The answer is 2.", {"role": "user", "content": "thanks"}),
        ("Bye 🦜", {"role": "user", "content": "again"}),
        ("Bye again.", None),
    ]
    engine = ScriptedEngine([reply for reply, _ in script])
    tok, session = engine.tokenizer, await engine.open_session()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "1+1?"}]
    for turn, (expected, follow_up) in enumerate(script):
        prompt = render(tok, messages)
        before = session.tokens
        result = await session.generate(prompt, CFG)
        m = result.metrics
        assert m.prompt_tokens == len(prompt)
        assert m.reused_tokens == len(before)  # everything read so far, assistant turns included
        assert m.prefilled_tokens == len(prompt) - len(before)
        assert result.token_ids[-1] == tok.eos_token_id and result.finish_reason == "stop"
        assert session.tokens == tuple(prompt) + result.token_ids[:-1]
        assert m.generated_tokens == len(result.token_ids)
        assert (m.kv_tokens, m.kv_bytes) == (len(session.tokens), KV_BYTES_PER_TOKEN * len(session.tokens))
        # Render the assistant turn from the generated ids, as the runner does.
        reply = tok.decode(result.token_ids).removesuffix("<|im_end|>")
        assert reply == result.text == expected == engine.calls[turn].reply
        messages.append({"role": "assistant", "content": reply})
        if follow_up is not None:
            messages.append(follow_up)
    assert engine.calls[1].prompt_text.endswith("<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n")
    engine.assert_complete()


async def test_concurrent_sessions_each_log_only_their_own_prompt_and_reply():
    engine = ScriptedEngine(["alpha reply", "beta reply"], decode_s_per_token=0.001)
    sessions = [await engine.open_session() for _ in range(2)]
    prompts = [user_prompt(engine, "needle-A"), user_prompt(engine, "needle-B")]
    results = {}

    async def run(i: int) -> None:
        results[i] = await sessions[i].generate(prompts[i], CFG)

    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(run, i)
    assert sorted(r.text for r in results.values()) == ["alpha reply", "beta reply"]
    for i, session in enumerate(sessions):
        assert session.tokens == tuple(prompts[i]) + results[i].token_ids[:-1]
        other = "needle-B" if i == 0 else "needle-A"
        assert other not in engine.tokenizer.decode(session.tokens)


async def test_a_prompt_equal_to_the_log_prefills_nothing_only_when_its_logits_are_known():
    engine = ScriptedEngine(["a", "b"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    metrics = await session.prefill(prompt)
    assert (metrics.reused_tokens, metrics.prefilled_tokens, metrics.generated_tokens) == (0, len(prompt), 0)
    again = await session.generate(prompt, CFG)
    assert (again.metrics.reused_tokens, again.metrics.prefilled_tokens) == (len(prompt), 0)
    # A prompt shorter than the log: the last prompt token is fed again to get its logits.
    shorter = await session.generate(prompt, CFG)
    assert (shorter.metrics.reused_tokens, shorter.metrics.prefilled_tokens) == (len(prompt) - 1, 1)
    assert engine.remaining_replies == 0


async def test_ttft_includes_the_scripted_prefill_time():
    engine = ScriptedEngine(["ok"], prefill_s_per_token=0.002)
    session = await engine.open_session()
    prompt = user_prompt(engine)
    result = await session.generate(prompt, CFG)
    assert result.metrics.ttft_s >= 0.002 * len(prompt) * 0.9


# ---- steps -------------------------------------------------------------------------------
async def test_steps_are_consumed_in_fifo_order_across_sessions():
    engine = ScriptedEngine(["first", "second"])
    engine.add_replies("third")
    a, b = await engine.open_session(), await engine.open_session()
    texts = [(await s.generate(user_prompt(engine), CFG)).text for s in (a, b, a)]
    assert texts == ["first", "second", "third"]
    assert [c.session_id for c in engine.calls] == [a.id, b.id, a.id]
    assert [c.index for c in engine.calls] == [0, 1, 2]


async def test_callable_steps_see_the_prompt_and_may_be_async():
    seen: list[ScriptedCall] = []

    def echo(call: ScriptedCall) -> str:
        seen.append(call)
        return f"{len(call.prompt_ids)} tokens"

    async def shout(call: ScriptedCall) -> str:
        await anyio.sleep(0)
        return call.prompt_text.split("\n")[1].split("<")[0].upper()

    engine = ScriptedEngine([echo, shout])
    session = await engine.open_session()
    prompt = user_prompt(engine, "hello")
    first = await session.generate(prompt, CFG)
    assert first.text == f"{len(prompt)} tokens" and seen[0].prompt_ids == tuple(prompt)
    assert (await session.generate(user_prompt(engine, "quiet"), CFG)).text == "QUIET"


async def test_an_exception_step_is_raised_before_the_log_changes():
    engine = ScriptedEngine([RuntimeError("model crashed"), "recovered"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    with pytest.raises(RuntimeError, match="model crashed"):
        await session.generate(prompt, CFG)
    assert session.tokens == ()
    assert engine.calls[0].reply is None and engine.calls[0].metrics is None
    assert (await session.generate(prompt, CFG)).text == "recovered"


async def test_running_out_of_steps_names_the_call():
    engine = ScriptedEngine("only")
    session = await engine.open_session()
    await session.generate(user_prompt(engine), CFG)
    with pytest.raises(AssertionError, match=r"ran out of replies at call #1 .*add_replies"):
        await session.generate(user_prompt(engine, "again"), CFG)
    assert len(engine.calls) == 2


async def test_assert_complete_fails_while_steps_remain():
    engine = ScriptedEngine(["used", "left over"])
    session = await engine.open_session()
    await session.generate(user_prompt(engine), CFG)
    with pytest.raises(AssertionError, match="1 scripted reply"):
        engine.assert_complete()
    await session.generate(user_prompt(engine), CFG)
    engine.assert_complete()


def test_steps_of_another_type_are_refused():
    with pytest.raises(UserError, match="scripted reply"):
        ScriptedEngine([42])  # type: ignore[list-item]


# ---- decoding ------------------------------------------------------------------------------
async def test_stream_yields_one_delta_per_token_and_never_splits_a_character():
    reply = "Parrot 🦜 and clef 𝄞!"
    engine = ScriptedEngine([reply])
    session = await engine.open_session()
    stream = session.stream(user_prompt(engine), CFG)
    deltas = [d async for d in stream]
    assert stream.result is not None
    assert [d.token_id for d in deltas] == list(stream.result.token_ids[:-1])  # EOS is no delta
    assert "".join(d.text for d in deltas) == stream.result.text == reply
    assert all("\ufffd" not in d.text for d in deltas)
    assert any(d.text == "" for d in deltas)  # a character's first bytes wait for the rest


async def test_stop_strings_cut_the_text_and_end_generation():
    engine = ScriptedEngine([f"Thinking... {TOOL_REPLY} trailing"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    result = await session.generate(prompt, GenerationConfig(max_new_tokens=64, stop_strings=("</tool_call>",)))
    assert result.finish_reason == "stop"
    assert result.text == "Thinking... " + TOOL_REPLY.removesuffix("</tool_call>")
    assert engine.tokenizer.eos_token_id not in result.token_ids
    assert session.tokens == tuple(prompt) + result.token_ids[:-1]


async def test_max_new_tokens_cuts_the_reply_with_finish_reason_length():
    engine = ScriptedEngine(["one two three four five", "unused"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    result = await session.generate(prompt, GenerationConfig(max_new_tokens=3))
    assert result.finish_reason == "length" and len(result.token_ids) == 3
    assert result.text == "one two three"
    assert session.tokens == tuple(prompt) + result.token_ids[:2]
    nothing = await session.generate(prompt, GenerationConfig(max_new_tokens=0))
    assert (nothing.token_ids, nothing.text, nothing.finish_reason) == ((), "", "length")
    assert session.tokens == tuple(prompt)


async def test_the_context_window_bounds_the_new_tokens_like_the_real_loop():
    engine = ScriptedEngine(["word " * 40], max_context_len=20)
    session = await engine.open_session()
    prompt = user_prompt(engine)
    result = await session.generate(prompt, CFG)
    assert len(result.token_ids) == 20 - len(prompt) and result.finish_reason == "length"


async def test_stop_token_ids_and_ignore_eos_are_honoured():
    engine = ScriptedEngine(["a b c", "ab"])
    tok, session = engine.tokenizer, await engine.open_session()
    b_id = tok.encode(" b")[0]
    stopped = await session.generate(user_prompt(engine), GenerationConfig(stop_token_ids=frozenset({b_id})))
    assert (stopped.token_ids[-1], stopped.text, stopped.finish_reason) == (b_id, "a", "stop")
    run_on = await session.generate(user_prompt(engine), GenerationConfig(max_new_tokens=5, ignore_eos=True))
    assert run_on.finish_reason == "length" and run_on.token_ids[-3:] == (tok.eos_token_id,) * 3


async def test_a_constraint_is_advanced_and_can_finish_generation():
    class TwoTokens:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def allowed_mask(self) -> None:
            return None

        def advance(self, token_id: int) -> None:
            self.seen.append(token_id)

        def is_finished(self) -> bool:
            return len(self.seen) >= 2

    engine = ScriptedEngine(["one two three"])
    constraint = TwoTokens()
    session = await engine.open_session()
    assert engine.make_constraint('{"type": "object"}') is None
    result = await session.generate(user_prompt(engine), CFG, constraint)
    assert result.finish_reason == "constraint" and list(result.token_ids) == constraint.seen
    call = engine.calls[0]
    assert call.constraint_given and call.grammar == '{"type": "object"}'
    assert engine.requested_grammars == ['{"type": "object"}']


async def test_beam_search_streams_one_delta_and_returns_the_hypothesis():
    engine = ScriptedEngine(["beamed"])
    session = await engine.open_session()
    stream = session.stream(user_prompt(engine), GenerationConfig(num_beams=2))
    deltas = [d async for d in stream]
    assert stream.result is not None and [d.text for d in deltas] == ["beamed"]
    assert stream.result.beams[0].token_ids == stream.result.token_ids


async def test_cancelling_mid_decode_keeps_every_fed_token_in_the_log():
    engine = ScriptedEngine(["one two three four five six seven eight", "done"], decode_s_per_token=0.01)
    session = await engine.open_session()
    prompt = user_prompt(engine)
    received: list[int] = []
    with anyio.CancelScope() as scope:
        async for delta in session.stream(prompt, CFG):
            received.append(delta.token_id)
            if len(received) == 3:
                scope.cancel()
    assert scope.cancelled_caught
    # The third token's feed had not started when the scope was cancelled: as on the real
    # engine, a step not yet begun is not run, and the log holds exactly what the KV holds.
    assert session.tokens == tuple(prompt) + tuple(received[:2])
    await session.check_integrity()
    assert engine.calls[0].result is None
    follow = list(session.tokens) + engine.tokenizer.encode(" more")
    result = await session.generate(follow, CFG)  # the lock was released
    assert result.metrics.reused_tokens == len(prompt) + 2


async def test_a_timeout_mid_decode_leaves_a_prefix_of_the_reply_in_the_log():
    engine = ScriptedEngine(["one two three four five six seven eight"], decode_s_per_token=0.02)
    session = await engine.open_session()
    prompt = user_prompt(engine)
    reply_ids = engine.tokenizer.encode("one two three four five six seven eight")
    with anyio.move_on_after(0.05):
        await session.generate(prompt, CFG)
    fed = session.tokens[len(prompt) :]
    assert session.tokens[: len(prompt)] == tuple(prompt)
    assert 0 < len(fed) < len(reply_ids) and fed == tuple(reply_ids[: len(fed)])


# ---- invariant -------------------------------------------------------------------------------
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(reply=st.text(max_size=40), budget=st.integers(min_value=0, max_value=30))
async def test_deltas_join_into_the_text_and_the_log_holds_all_but_the_last_token(reply: str, budget: int):
    engine = ScriptedEngine([reply])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    stream = session.stream(prompt, GenerationConfig(max_new_tokens=budget))
    text = "".join([d.text async for d in stream])
    result = stream.result
    assert result is not None and text == result.text
    planned = engine.tokenizer.encode(reply) + [engine.tokenizer.eos_token_id]
    assert result.token_ids == tuple(planned[:budget])
    fed = result.token_ids[:-1] if result.token_ids else ()
    assert session.tokens == tuple(prompt) + fed
    if budget >= len(planned):
        assert text == engine.tokenizer.decode(planned[:-1])
