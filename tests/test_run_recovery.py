"""Runs that go wrong leave a usable session: oversized input, cut-off and malformed tool calls."""

from __future__ import annotations

import json

import pytest

from agentkv import Agent, GenerationConfig, Runtime, tool
from agentkv.errors import ContextOverflowError, MaxModelCallsExceeded, UserError
from agentkv.events import RunFinished
from agentkv.memory import Store
from agentkv.policies import Truncation
from agentkv.testing import ScriptedEngine


@tool
def remember(key: str, value: str) -> str:
    """Store a value under a key."""
    return "ok"


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def open_session(engine, agent):
    runtime = Runtime(engine)
    return runtime, await runtime.open_conversation(agent)


# ---- oversized input ------------------------------------------------------------------------
@pytest.mark.parametrize("policy", [None, Truncation()])
async def test_an_input_that_cannot_fit_is_refused_before_it_is_recorded_and_the_next_one_works(policy):
    engine = ScriptedEngine(["fine", "still fine"])
    agent = Agent(name="a", policy=policy, max_prompt_len=300, min_response_len=32)
    runtime, session = await open_session(engine, agent)
    await runtime.run(session, "hello")
    before = list(session.messages)
    with pytest.raises(ContextOverflowError, match="nothing was recorded") as caught:
        await runtime.run(session, "word " * 400)
    assert caught.value.prompt_tokens > caught.value.limit == 300 - 32
    assert session.messages == before  # nothing recorded, nothing left in the window
    result = await runtime.run(session, "a normal question")
    assert result.final_text == "still fine"
    engine.assert_complete()


class KeepEverything:
    """A policy that removes nothing: only the runner's final check can refuse the prompt."""

    name = "keep_everything"

    async def compact(self, session, agent, *, limit):
        return
        yield


async def test_an_input_the_policy_cannot_make_room_for_leaves_the_window_but_stays_stored():
    engine = ScriptedEngine(["first answer", "ok"])
    agent = Agent(name="a", policy=KeepEverything(), max_prompt_len=300, min_response_len=32)
    runtime, session = await open_session(engine, agent)
    removed = []

    async def hook(session, gone, replacement):
        removed.extend(entry.message for entry in gone)

    session.on_window_change = hook
    await runtime.run(session, "hello " * 150)
    text = "again " * 150  # fits alone, not beside the first exchange, and the policy frees nothing
    with pytest.raises(ContextOverflowError, match="left"):
        await runtime.run(session, text)
    assert all(m.content != text for m in session.messages)  # out of the window...
    assert [m.content for m in removed] == [text]  # ...and marked so in the store (the hook)
    result = await runtime.run(session, "short")  # the next normal message works
    assert result.final_text == "ok"
    assert [m.role for m in session.messages] == ["user", "assistant", "user", "assistant"]
    engine.assert_complete()


# ---- cut-off and malformed tool calls ---------------------------------------------------------
async def test_a_tool_call_cut_by_the_token_limit_is_retried_with_room_and_runs():
    long_call = call("remember", key="name", value="x" * 120)
    engine = ScriptedEngine([long_call, long_call, "Saved."])
    agent = Agent(name="a", tools=[remember], tool_choice="required",
                  generation=GenerationConfig(max_new_tokens=32))
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "remember my name")
    assert [c.name for c in result.tool_calls] == ["remember"]
    assert engine.calls[1].config.max_new_tokens >= 256  # the retry had room for the call
    assert result.final_text == "Saved." and result.finish_reason == "stop"


async def test_a_call_still_cut_after_the_retry_ends_the_run_without_markup_in_the_answer():
    long_call = "Let me save that. " + call("remember", key="name", value="y" * 2000)
    engine = ScriptedEngine([long_call, long_call])
    agent = Agent(name="a", tools=[remember], generation=GenerationConfig(max_new_tokens=32),
                  max_prompt_len=600, min_response_len=32)
    runtime, session = await open_session(engine, agent)
    events = [e async for e in runtime.run_stream(session, "remember my name")]
    final = events[-1]
    assert isinstance(final, RunFinished) and final.result.finish_reason == "tool_call_cut"
    assert final.result.final_text == "Let me save that." and "<tool_call>" not in final.result.final_text
    assert final.result.tool_calls == ()
    assert "<tool_call>" not in session.messages[-1].content  # the history holds no broken markup
    engine.assert_complete()


async def test_malformed_call_markup_is_never_presented_as_the_answer():
    engine = ScriptedEngine(['Sure. <tool_call>{"name": remember}</tool_call>'])
    agent = Agent(name="a", tools=[remember], constrain_tool_calls=False)
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "hi")
    assert result.finish_reason == "tool_call_invalid"
    assert result.final_text == "Sure."


async def test_finish_reason_says_when_a_plain_answer_was_cut():
    engine = ScriptedEngine(["one two three four five six seven eight nine ten eleven twelve"])
    agent = Agent(name="a", generation=GenerationConfig(max_new_tokens=4))
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "count")
    assert result.finish_reason == "length"


async def test_max_turns_carries_the_run_so_far():
    engine = ScriptedEngine([call("remember", key="a", value="b")] * 2)
    agent = Agent(name="a", tools=[remember], max_model_calls=2)
    runtime, session = await open_session(engine, agent)
    with pytest.raises(MaxModelCallsExceeded) as caught:
        await runtime.run(session, "loop")
    assert caught.value.result.finish_reason == "max_model_calls"
    assert len(caught.value.result.tool_calls) == 2


async def test_after_a_refused_input_a_new_process_resumes_and_answers(tmp_path):
    from agentkv.memory import Store

    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    agent = Agent(name="a", max_prompt_len=300, min_response_len=32)
    first = Runtime(ScriptedEngine(["fine"]), Store(url), agents=[agent])
    session = await first.open_conversation(agent, conversation_id="big")
    await first.run(session, "hello")
    with pytest.raises(ContextOverflowError):
        await first.run(session, "word " * 400)
    await first.aclose()
    later = Runtime(ScriptedEngine(["welcome back"]), Store(url), agents=[agent])
    resumed = await later.resume("big")
    assert [m.content for m in resumed.messages] == ["hello", "fine"]
    assert (await later.run(resumed, "still there?")).final_text == "welcome back"


# ---- continuing from a message --------------------------------------------------------------
async def test_continue_from_leaves_a_failed_runs_input_out_of_the_window(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}")
    engine = ScriptedEngine(["Hello!", RuntimeError("the model crashed"), "Welcome back."])
    runtime = Runtime(engine, store)
    session = await runtime.open_conversation(Agent(name="a"))
    await runtime.run(session, "Hi")
    last = await store.last_seq(session.id)
    with pytest.raises(RuntimeError):
        await runtime.run(session, "Lost words")
    result = await runtime.run(session, "Retry", continue_from=last)
    assert result.final_text == "Welcome back." and "Lost words" not in engine.calls[2].prompt_text
    assert [m.content for m in session.messages] == ["Hi", "Hello!", "Retry", "Welcome back."]
    assert len(await store.messages(session.id)) == 5  # the failed input is kept, out of the window
    with pytest.raises(UserError, match="needs a store"):
        await Runtime(engine).run(session, "x", continue_from=1)
