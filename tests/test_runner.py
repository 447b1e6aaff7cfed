"""The agent loop on the scripted engine: tool use, errors, limits, cancellation, events."""

from __future__ import annotations

import dataclasses
import json

import anyio
import pytest

from agentkv import Agent, Runtime, tool
from agentkv.chat.messages import Message
from agentkv.chat.render import ChatRenderer
from agentkv.errors import MaxModelCallsExceeded, ConversationBusy
from agentkv.events import (
    ContextCompacted,
    ModelCallFinished,
    RunFinished,
    TextDelta,
    ToolCalled,
    ToolReturned,
)
from agentkv.run.loop import CANCELLED_RESULT
from agentkv.testing import ScriptedEngine
from agentkv.tools import calculator


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@tool
def explode(reason: str) -> str:
    """Always fails."""
    raise RuntimeError(f"boom: {reason}")


@tool(timeout_s=0.2)
async def slow(seconds: float) -> str:
    """Sleeps."""
    await anyio.sleep(seconds)
    return "done"


async def open_session(engine, agent):
    runtime = Runtime(engine)
    return runtime, await runtime.open_conversation(agent)


async def test_multi_step_tool_use_feeds_results_back_and_finishes():
    engine = ScriptedEngine([call("add", a=2, b=3), "The sum is 5."])
    agent = Agent(name="math", tools=[add])
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "What is 2+3?")
    assert result.final_text == "The sum is 5."
    assert [c.name for c in result.tool_calls] == ["add"]
    assert [m.role for m in session.messages] == ["user", "assistant", "tool", "assistant"]
    assert session.messages[2].content == "5"
    assert "5" in engine.calls[1].prompt_text.split("<|im_start|>tool")[-1]
    engine.assert_complete()


async def test_without_parallel_tool_calls_the_grammar_allows_one_call_per_step():
    engine = ScriptedEngine([call("add", a=1, b=2), "3", call("add", a=1, b=2), "3"])
    for parallel in (True, False):
        agent = Agent(name=f"math-{parallel}", tools=[add], parallel_tool_calls=parallel)
        runtime, session = await open_session(engine, agent)
        await runtime.run(session, "1+2?")
        grammar = engine.requested_grammars[-2]  # the first step's
        assert ("more_1" in grammar) is parallel
    engine.assert_complete()


async def test_a_tool_with_a_namespaced_name_is_offered_called_and_answered():
    @tool(name="math.factorial")
    def factorial(n: int) -> int:
        """n!"""
        result = 1
        for k in range(2, n + 1):
            result *= k
        return result

    engine = ScriptedEngine([call("math.factorial", n=5), "5! is 120."])
    agent = Agent(name="math", tools=[factorial])
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "What is 5!?")
    assert [c.name for c in result.tool_calls] == ["math.factorial"]
    assert session.messages[2].content == "120" and result.final_text == "5! is 120."
    assert "math.factorial" in engine.requested_grammars[0]  # the grammar lets the model call it
    engine.assert_complete()


async def test_second_step_prefills_only_the_tool_result_delta():
    engine = ScriptedEngine([call("add", a=1, b=1), "2"])
    agent = Agent(name="math", tools=[add])
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "1+1?")
    first, second = result.call_metrics
    assert second.reused_tokens >= first.prompt_tokens
    assert second.prefilled_tokens < 40


async def test_parallel_calls_run_and_results_keep_call_order():
    engine = ScriptedEngine([call("add", a=1, b=2) + "\n" + call("add", a=10, b=20), "3 and 30"])
    agent = Agent(name="math", tools=[add])
    runtime, session = await open_session(engine, agent)
    await runtime.run(session, "two sums")
    tool_messages = [m for m in session.messages if m.role == "tool"]
    assert [m.content for m in tool_messages] == ["3", "30"]
    calls = session.messages[1].tool_calls
    assert [m.tool_call_id for m in tool_messages] == [c.id for c in calls]


async def test_tool_exception_becomes_an_error_result_and_the_loop_continues():
    engine = ScriptedEngine([call("explode", reason="x"), "It failed."])
    agent = Agent(name="a", tools=[explode])
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "go")
    assert result.final_text == "It failed."
    assert "boom: x" in session.messages[2].content


async def test_tool_timeout_is_reported_to_the_model():
    engine = ScriptedEngine([call("slow", seconds=5), "too slow"])
    agent = Agent(name="a", tools=[slow])
    runtime, session = await open_session(engine, agent)
    await runtime.run(session, "go")
    assert "timed out" in session.messages[2].content


async def test_invalid_arguments_and_unknown_tools_come_back_as_errors():
    engine = ScriptedEngine([call("add", a="x", b=1) + "\n" + call("nope"), "ok"])
    agent = Agent(name="a", tools=[add])
    runtime, session = await open_session(engine, agent)
    await runtime.run(session, "go")
    results = [m.content for m in session.messages if m.role == "tool"]
    assert "invalid arguments" in results[0]
    assert "unknown tool" in results[1]


async def test_max_turns_exceeded_raises_and_keeps_the_history():
    engine = ScriptedEngine([call("add", a=1, b=1)] * 3)
    agent = Agent(name="a", tools=[add], max_model_calls=3)
    runtime, session = await open_session(engine, agent)
    with pytest.raises(MaxModelCallsExceeded):
        await runtime.run(session, "loop")
    assert [m.role for m in session.messages].count("tool") == 3
    # the session stays usable
    engine.add_replies("fine")
    result = await runtime.run(session, "stop now")
    assert result.final_text == "fine"


async def test_stream_events_arrive_in_order():
    engine = ScriptedEngine([call("add", a=2, b=2), "four"])
    agent = Agent(name="a", tools=[add])
    runtime, session = await open_session(engine, agent)
    kinds = [event.type async for event in runtime.run_stream(session, "2+2")]
    assert kinds[0] == "model_call_finished"  # the tool-call markup is not streamed as text
    assert kinds[1:4] == ["tool_called", "tool_returned", "text_delta"]
    assert kinds[-2:] == ["model_call_finished", "run_finished"]


async def test_text_before_a_tool_call_is_streamed_and_markup_hidden():
    engine = ScriptedEngine(["Let me add. " + call("add", a=1, b=2), "3"])
    agent = Agent(name="a", tools=[add])
    runtime, session = await open_session(engine, agent)
    events = [e async for e in runtime.run_stream(session, "1+2")]
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text == "Let me add. 3"
    assert any(isinstance(e, ToolCalled) for e in events)
    assert any(isinstance(e, ToolReturned) and e.content == "3" for e in events)
    assert isinstance(events[-1], RunFinished)


async def test_cancellation_mid_decode_leaves_session_consistent():
    engine = ScriptedEngine(["a long answer " * 20, "short"], decode_s_per_token=0.01)
    agent = Agent(name="a")
    runtime, session = await open_session(engine, agent)
    with anyio.move_on_after(0.2):
        await runtime.run(session, "talk")
    assert [m.role for m in session.messages] == ["user"]
    prompt = tuple(engine.calls[0].prompt_ids)
    kv_tokens = session.kv.tokens
    assert kv_tokens[: len(prompt)] == prompt  # the log is the prompt plus the tokens fed so far
    assert len(kv_tokens) < len(prompt) + len(engine.tokenizer.encode("a long answer " * 20))
    result = await runtime.run(session, "again")
    assert result.final_text == "short"


async def test_cancellation_mid_tool_keeps_the_call_and_drops_nothing():
    engine = ScriptedEngine([call("slow", seconds=0.15)], decode_s_per_token=0.0)
    agent = Agent(name="a", tools=[slow])
    runtime, session = await open_session(engine, agent)
    with anyio.move_on_after(0.05):
        await runtime.run(session, "go")
    assert [m.role for m in session.messages] == ["user", "assistant", "tool"]
    made = session.messages[1].tool_calls[0]
    assert made.name == "slow"
    # the call is never left without a result (an orphaned call would poison every later prompt)
    assert session.messages[2].tool_call_id == made.id
    assert session.messages[2].content == CANCELLED_RESULT


async def test_a_second_concurrent_run_on_one_session_raises_session_busy():
    engine = ScriptedEngine(["one " * 10, "two"], decode_s_per_token=0.01)
    agent = Agent(name="a")
    runtime, session = await open_session(engine, agent)
    async with anyio.create_task_group() as tg:
        tg.start_soon(runtime.run, session, "first")
        await anyio.sleep(0.02)
        with pytest.raises(ConversationBusy):
            await runtime.run(session, "second")


async def test_turn_metrics_are_reported_per_model_call():
    engine = ScriptedEngine([call("calculator", expression="6*7"), "42"])
    agent = Agent(name="a", tools=[calculator])
    runtime, session = await open_session(engine, agent)
    events = [e async for e in runtime.run_stream(session, "6*7?")]
    metrics = [e for e in events if isinstance(e, ModelCallFinished)]
    assert [m.call_index for m in metrics] == [0, 1]
    assert session.messages[2].content == "42"


async def test_runtime_registers_the_agents_system_prompt_as_a_shared_prefix():
    engine = ScriptedEngine([])
    agent = Agent(name="a", instructions="Be brief.", tools=[add])
    runtime = Runtime(engine)
    await runtime.open_conversation(agent)
    (prefix,) = engine.registered_prefixes
    assert "Be brief." in engine.tokenizer.decode(prefix)


def test_agent_rejects_misuse_with_user_errors():
    from agentkv.errors import UserError

    with pytest.raises(UserError):
        Agent(name="a", tools=[add, add])
    with pytest.raises(UserError):
        Agent(name="a", tools=[add], tool_choice="missing_tool")
    with pytest.raises(UserError):
        Agent(name="a", tool_choice="required")
    with pytest.raises(UserError):
        Agent(name="", tools=[add])


async def test_closing_a_stream_early_releases_the_session_for_the_next_run():
    from contextlib import aclosing

    engine = ScriptedEngine(["a long answer " * 20, "next"], decode_s_per_token=0.001)
    agent = Agent(name="a")
    runtime, session = await open_session(engine, agent)
    async with aclosing(runtime.run_stream(session, "talk")) as events:
        async for event in events:
            if event.type == "text_delta":
                break
    result = await runtime.run(session, "again")
    assert result.final_text == "next"


def cut_after_first_block(engine: ScriptedEngine, reply: str) -> int:
    """max_new_tokens that cut ``reply`` (two blocks) just after the "\\n<" that opens the second."""
    ids = engine.tokenizer.encode(reply)
    return next(n for n in range(1, len(ids)) if engine.tokenizer.decode(ids[:n]).endswith(">\n<"))


async def test_a_parallel_call_cut_after_a_complete_one_is_retried_and_both_run_without_markup_in_text():
    reply = call("add", a=1, b=2) + "\n" + call("add", a=3, b=4)
    engine = ScriptedEngine([reply, reply, "3 and 7."])
    agent = Agent(name="math", tools=[add], tool_choice="required",
                  generation={"max_new_tokens": cut_after_first_block(engine, reply)})
    runtime, session = await open_session(engine, agent)
    events = [event async for event in runtime.run_stream(session, "1+2 and 3+4?")]
    result = events[-1].result
    assert engine.calls[1].config.max_new_tokens > engine.calls[0].config.max_new_tokens  # the retry
    assert [c.arguments for c in result.tool_calls] == [{"a": 1, "b": 2}, {"a": 3, "b": 4}]
    assert [m.content for m in session.messages if m.role == "tool"] == ["3", "7"]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "3 and 7."
    assert all("<" not in m.content for m in session.messages if m.role == "assistant")
    engine.assert_complete()


async def test_a_parallel_call_still_cut_after_the_retry_is_reported_as_cut_and_no_markup_is_text():
    # NOTE: the second call outgrows all the room a retry gets
    reply = call("add", a=1, b=2) + "\n" + call("explode", reason="x" * 12000)
    engine = ScriptedEngine([reply, reply])
    agent = Agent(name="math", tools=[add, explode],
                  generation={"max_new_tokens": cut_after_first_block(engine, reply)},
                  max_prompt_len=900, min_response_len=32)
    runtime, session = await open_session(engine, agent)
    events = [event async for event in runtime.run_stream(session, "1+2?")]
    result = events[-1].result
    assert result.finish_reason == "tool_call_cut" and result.final_text == ""
    assert not any(isinstance(e, TextDelta) and "<" in e.text for e in events)
    assert session.messages[-1].role == "assistant" and "<" not in session.messages[-1].content
    engine.assert_complete()


async def test_identical_calls_in_one_model_call_run_once():
    ran: list[int] = []

    @tool
    def double(n: int) -> int:
        """Double a number."""
        ran.append(n)
        return 2 * n

    same = call("double", n=4)
    engine = ScriptedEngine(["\n".join([same, same, call("double", n=5), same]), "8 and 10."])
    agent = Agent(name="math", tools=[double])
    runtime, session = await open_session(engine, agent)
    result = await runtime.run(session, "Double 4 and 5.")
    assert sorted(ran) == [4, 5] and [c.arguments for c in result.tool_calls] == [{"n": 4}, {"n": 5}]
    assert [m.content for m in session.messages if m.role == "tool"] == ["8", "10"]
    assert result.final_text == "8 and 10."
    engine.assert_complete()


@pytest.fixture
def prompt_renders(monkeypatch) -> list[int]:
    """Records the length of each prompt ``ChatRenderer.render`` renders (a ``message_tokens``
    sizing of one recorded message is not a prompt and is left out)."""
    rendered: list[int] = []
    sizing = [False]
    render, message_tokens = ChatRenderer.render, ChatRenderer.message_tokens

    def counted_render(self, *args, **kwargs):
        prompt = render(self, *args, **kwargs)
        if not sizing[0]:
            rendered.append(len(prompt.token_ids))
        return prompt

    def uncounted_message_tokens(self, *args, **kwargs):
        sizing[0] = True
        try:
            return message_tokens(self, *args, **kwargs)
        finally:
            sizing[0] = False

    monkeypatch.setattr(ChatRenderer, "render", counted_render)
    monkeypatch.setattr(ChatRenderer, "message_tokens", uncounted_message_tokens)
    return rendered


async def test_the_prompt_is_rendered_once_per_model_call_retry_included(prompt_renders):
    reply = call("add", a=1, b=2) + "\n" + call("add", a=3, b=4)
    engine = ScriptedEngine([call("add", a=2, b=3), reply, reply, "Done."])
    agent = Agent(name="math", tools=[add], generation={"max_new_tokens": cut_after_first_block(engine, reply)})
    runtime, session = await open_session(engine, agent)
    prompt_renders.clear()  # opening renders the agent's shared prefix once
    events = [event async for event in runtime.run_stream(session, "Add things.")]
    model_calls = sum(isinstance(e, ModelCallFinished) for e in events)
    assert model_calls == 3 and len(engine.calls) == 4  # the second model call was retried
    assert len(prompt_renders) == model_calls
    assert prompt_renders == [len(c.prompt_ids) for c in engine.calls if c is not engine.calls[2]]
    engine.assert_complete()


class DropOldest:
    """A context policy that takes the oldest message out of the window and renders nothing."""

    name = "drop_oldest"

    async def compact(self, conversation, agent, *, limit):
        await conversation.replace_in_window(conversation.window[:1])
        yield ContextCompacted(self.name, 0, 0, 1, 0.0)


async def test_a_compaction_adds_one_render_of_the_new_window_and_a_policy_one_input_sizing(prompt_renders):
    engine = ScriptedEngine(["first answer", "second"])
    agent = Agent(name="a", policy=DropOldest(), min_response_len=8)
    runtime, session = await open_session(engine, agent)
    await runtime.run(session, "hello " * 20)
    text = "more " * 20
    full = len(session.render_with(agent, [*session.messages, Message.user(text)]).token_ids)
    session.agent = dataclasses.replace(agent, max_prompt_len=full - 2 + agent.min_response_len)
    before = len(prompt_renders)
    events = [event async for event in runtime.run_stream(session, text)]
    assert events[-1].result.final_text == "second"
    assert sum(isinstance(e, ContextCompacted) for e in events) == 1
    # the input's sizing (system prompt + the new message: a policy can free the history), the
    # prompt over the window, and the prompt over the window the compaction left
    assert len(prompt_renders) - before == 3
    assert prompt_renders[-2] == full and prompt_renders[-1] == len(engine.calls[-1].prompt_ids) < full
    engine.assert_complete()
