"""``agentkv serve``'s app driven by the client libraries users bring: ``openai``, ``openai-agents``,
``pydantic-ai``, ``langchain-openai``, and ``instructor``'s request shapes (sent with ``openai``:
instructor pins a ``jiter`` that openai 3.x cannot share). Per library: a plain answer, a stream,
a tool-call round trip and structured output, on Chat Completions and Responses where the library
has both. The request/response shapes run in process on the scripted engine; a few end-to-end
cases run on the default model (``model``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

openai = pytest.importorskip("openai")

KEY = "sk-clients"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


class Weather(BaseModel):
    city: str
    temperature_c: int


WEATHER_JSON = '{"city": "Oslo", "temperature_c": 3}'


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


CALL_THEN_TEXT = call("get_weather", city="Oslo") + "\nChecking."
"""A step whose text follows its call: the Responses output is [function_call, message], the order
openai-agents and pydantic-ai replay as input."""


class Served:
    """The app on a scripted engine (and a store), with an ``openai.AsyncOpenAI`` bound to it in process."""

    def __init__(self, steps: list, tmp_path: Path) -> None:
        self.engine = ScriptedEngine(steps)
        self.app = create_app(self.engine, store=Store(f"sqlite:///{tmp_path / 'clients.db'}"), api_key=KEY,
                              model_id="scripted")
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://test")
        self.openai = openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, http_client=self.http, max_retries=0)

    def prompt(self, call_index: int) -> str:
        return self.engine.calls[call_index].prompt_text


@pytest.fixture
def served(tmp_path: Path):
    def make(*steps) -> Served:
        return Served(list(steps), tmp_path)
    return make


# ---- openai ---------------------------------------------------------------------------------------
async def test_openai_chat_plain_stream_tools_and_parse(served):
    s = served("Hello!", "Streamed hello.", call("get_weather", city="Oslo"), "It is 3 C.", WEATHER_JSON)
    client = s.openai
    plain = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}])
    assert plain.choices[0].message.content == "Hello!" and plain.choices[0].finish_reason == "stop"
    stream = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                                  stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Streamed hello."
    assert chunks[-1].usage.completion_tokens > 0
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}]
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=tools)
    [tool_call] = first.choices[0].message.tool_calls
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": "3 C"}]
    second = await client.chat.completions.create(model="m", messages=messages, tools=tools)
    assert second.choices[0].message.content == "It is 3 C." and second.usage.prompt_tokens_details.cached_tokens > 0
    parsed = await client.chat.completions.parse(model="m", messages=[{"role": "user", "content": "Oslo?"}],
                                                 response_format=Weather)
    assert parsed.choices[0].message.parsed == Weather(city="Oslo", temperature_c=3)
    s.engine.assert_complete()


async def test_openai_responses_create_stream_parse_and_replayed_output(served):
    s = served("Hello!", "Streamed hello.", WEATHER_JSON, CALL_THEN_TEXT, "It is 3 C.")
    client = s.openai
    first = await client.responses.create(model="m", input="Hi")
    assert first.output_text == "Hello!"
    async with client.responses.stream(model="m", input="Again", previous_response_id=first.id) as stream:
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        final = await stream.get_final_response()
    assert "".join(deltas) == final.output_text == "Streamed hello."
    parsed = await client.responses.parse(model="m", input="Oslo?", text_format=Weather)
    assert parsed.output_parsed == Weather(city="Oslo", temperature_c=3)
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_PARAMS, "strict": False}
    asked = await client.responses.create(model="m", input=[{"role": "user", "content": "Weather in Oslo?"}],
                                          tools=[tool])
    assert [item.type for item in asked.output] == ["function_call", "message"]
    [fc] = [item for item in asked.output if item.type == "function_call"]
    # the guide's pattern: the whole output replayed as input, then the result (a new stored chain)
    replay = [{"role": "user", "content": "Weather in Oslo?"},
              *[item.model_dump(exclude_none=True) for item in asked.output],
              {"type": "function_call_output", "call_id": fc.call_id, "output": "3 C"}]
    answer = await client.responses.create(model="m", input=replay, tools=[tool])
    assert answer.output_text == "It is 3 C."
    s.engine.assert_complete()


async def test_openai_stream_helpers_end_cleanly_at_the_token_limit(served):
    long_answer = "one two three four five six seven eight nine ten " * 4
    s = served(long_answer, long_answer)
    client = s.openai
    async with client.responses.stream(model="m", input="Count", max_output_tokens=5) as stream:
        events = [event async for event in stream]
    # NOTE: the helper's get_final_response() wants response.completed (it raises on an incomplete
    # response from OpenAI too): the incomplete response is the last event's
    final = events[-1].response
    assert events[-1].type == "response.incomplete" and final.status == "incomplete"
    assert final.incomplete_details.reason == "max_output_tokens" and final.output_text
    async with client.chat.completions.stream(model="m", messages=[{"role": "user", "content": "Count"}],
                                              max_tokens=5) as chat_stream:
        kinds = [event.type async for event in chat_stream]
        with pytest.raises(openai.LengthFinishReasonError) as cut:  # the helper's way to say "length", as on OpenAI
            await chat_stream.get_final_completion()
    completion = cut.value.completion
    assert kinds[-1] == "content.done" and completion.choices[0].finish_reason == "length"
    assert completion.choices[0].message.content


# ---- openai-agents --------------------------------------------------------------------------------
@pytest.fixture
def agents_sdk():
    sdk = pytest.importorskip("agents")
    sdk.set_tracing_disabled(True)
    return sdk


def agents_model(sdk, s: Served, api: str):
    if api == "chat":
        return sdk.OpenAIChatCompletionsModel(model="scripted", openai_client=s.openai)
    return sdk.OpenAIResponsesModel(model="scripted", openai_client=s.openai)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_openai_agents_plain_tools_structured_and_streamed(agents_sdk, served, api):
    sdk = agents_sdk
    s = served("Hello!", CALL_THEN_TEXT, "It is 3 C in Oslo.", WEATHER_JSON, "Streamed hello.")
    model = agents_model(sdk, s, api)
    seen = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "3 C"

    plain = await sdk.Runner.run(sdk.Agent(name="a", instructions="Be brief.", model=model), "Hi")
    assert plain.final_output == "Hello!"
    tooled = await sdk.Runner.run(sdk.Agent(name="a", instructions="Be brief.", model=model, tools=[get_weather]),
                                  "Weather in Oslo?")
    assert seen == ["Oslo"] and tooled.final_output == "It is 3 C in Oslo."
    assert "3 C" in s.prompt(2)  # the tool's result went back to the model
    typed = await sdk.Runner.run(sdk.Agent(name="a", model=model, output_type=Weather), "Oslo?")
    assert typed.final_output == Weather(city="Oslo", temperature_c=3)
    streamed = sdk.Runner.run_streamed(sdk.Agent(name="a", model=model), "Hi")
    deltas = [e.data.delta async for e in streamed.stream_events()
              if e.type == "raw_response_event" and getattr(e.data, "type", "") in
              ("response.output_text.delta",)]
    assert "".join(deltas) == streamed.final_output == "Streamed hello."
    s.engine.assert_complete()


# ---- pydantic-ai ----------------------------------------------------------------------------------
def pydantic_ai_model(s: Served, api: str):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(openai_client=s.openai)
    if api == "chat":
        return OpenAIChatModel("scripted", provider=provider)
    return OpenAIResponsesModel("scripted", provider=provider)


@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_pydantic_ai_plain_tools_structured_and_streamed(served, api):
    s = served("Hello!", CALL_THEN_TEXT, "It is 3 C in Oslo.", WEATHER_JSON,
               call("final_result", city="Oslo", temperature_c=3), "Streamed hello.")
    model = pydantic_ai_model(s, api)
    from pydantic_ai import Agent
    from pydantic_ai.output import NativeOutput

    plain = await Agent(model, instructions="Be brief.").run("Hi")
    assert plain.output == "Hello!"
    tooled_agent = Agent(model, instructions="Be brief.")
    seen = []

    @tooled_agent.tool_plain
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "3 C"

    tooled = await tooled_agent.run("Weather in Oslo?")
    assert seen == ["Oslo"] and tooled.output == "It is 3 C in Oslo." and "3 C" in s.prompt(2)
    native = await Agent(model, output_type=NativeOutput(Weather)).run("Oslo?")
    assert native.output == Weather(city="Oslo", temperature_c=3)
    as_tool = await Agent(model, output_type=Weather).run("Oslo?")  # pydantic-ai's default: an output tool
    assert as_tool.output == Weather(city="Oslo", temperature_c=3)
    async with Agent(model).run_stream("Hi") as streamed:
        text = "".join([delta async for delta in streamed.stream_text(delta=True)])
    assert text == "Streamed hello."
    s.engine.assert_complete()


# ---- langchain-openai -----------------------------------------------------------------------------
@pytest.mark.parametrize("api", ["chat", "responses"])
async def test_langchain_openai_plain_stream_tools_and_structured(served, api):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    s = served("Hello!", "Streamed hello.", call("get_weather", city="Oslo"), "It is 3 C in Oslo.", WEATHER_JSON)
    llm = ChatOpenAI(model="scripted", base_url="http://test/v1", api_key=KEY, http_async_client=s.http,
                     max_retries=0, use_responses_api=api == "responses")
    assert (await llm.ainvoke("Hi")).text == "Hello!"
    assert "".join([chunk.text async for chunk in llm.astream("Hi")]) == "Streamed hello."

    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "3 C"

    tooled = llm.bind_tools([get_weather])
    messages = [HumanMessage("Weather in Oslo?")]
    asked = await tooled.ainvoke(messages)
    [tool_call] = asked.tool_calls
    assert tool_call["name"] == "get_weather" and tool_call["args"] == {"city": "Oslo"}
    messages += [asked, ToolMessage(get_weather(**tool_call["args"]), tool_call_id=tool_call["id"])]
    assert (await tooled.ainvoke(messages)).text == "It is 3 C in Oslo."
    typed = await llm.with_structured_output(Weather).ainvoke("Oslo?")  # json_schema, langchain's default
    assert typed == Weather(city="Oslo", temperature_c=3)
    s.engine.assert_complete()


# ---- instructor's request shapes ------------------------------------------------------------------
def instructor_tool_schema() -> dict:
    """What instructor's TOOLS mode sends for ``Weather`` (its generate_openai_schema)."""
    return {"name": "Weather", "description": "Correctly extracted `Weather` with all the required parameters "
            "with correct types", "parameters": Weather.model_json_schema()}


async def test_instructor_tools_mode_with_its_reask_and_json_schema_mode(served):
    s = served(call("Weather", city="Oslo", temperature_c="cold"), call("Weather", city="Oslo", temperature_c=3),
               WEATHER_JSON)
    client = s.openai
    forced = {"tools": [{"type": "function", "function": instructor_tool_schema()}],
              "tool_choice": {"type": "function", "function": {"name": "Weather"}}}
    messages = [{"role": "user", "content": "Oslo is at 3 C."}]
    first = await client.chat.completions.create(model="m", messages=messages, **forced)
    [bad] = first.choices[0].message.tool_calls
    # instructor's reask: the assistant message dumped whole, then a tool message per call with the error
    messages += [first.choices[0].message.model_dump(),
                 {"role": "tool", "tool_call_id": bad.id, "name": bad.function.name,
                  "content": "Validation Error found:\ntemperature_c: not an int\n"
                             "Recall the function correctly, fix the errors"}]
    second = await client.chat.completions.create(model="m", messages=messages, **forced)
    [good] = second.choices[0].message.tool_calls
    assert Weather.model_validate_json(good.function.arguments) == Weather(city="Oslo", temperature_c=3)
    schema_mode = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "Oslo?"}],
                                                       response_format={"type": "json_schema", "json_schema": {
                                                           "name": "Weather", "schema": Weather.model_json_schema()}})
    assert Weather.model_validate_json(schema_mode.choices[0].message.content) == Weather(city="Oslo", temperature_c=3)
    s.engine.assert_complete()


