"""``agentkv serve``'s app driven by the client libraries users bring: ``openai``, ``openai-agents``,
``pydantic-ai``, ``langchain-openai``, and ``instructor``'s request shapes (sent with ``openai``:
instructor pins a ``jiter`` that openai 3.x cannot share). Per library: a plain answer, a stream,
a tool-call round trip and structured output, on Chat Completions and Responses where the library
has both. The request/response shapes run in process on the scripted engine; a few end-to-end
cases run on the default model (``model``).

The tests here run the real model; the scripted ones are in ``tests/test_clients.py``."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import BaseModel
from test_clients import KEY, instructor_tool_schema, openai
from test_clients import agents_sdk  # noqa: F401  (a fixture)

from agentkv.memory import Store
from agentkv.server import create_app

pytestmark = pytest.mark.model


# ---- end to end on the default model --------------------------------------------------------------
class City(BaseModel):
    city: str
    country: str


@pytest.fixture
async def real_openai(engine, tmp_path: Path):
    """An ``openai.AsyncOpenAI`` on the app over the default model (its lifespan run, so its
    sessions close and the shared engine stays clean)."""
    app = create_app(engine, store=Store(f"sqlite:///{tmp_path / 'real.db'}"), api_key=KEY, model_id="default")
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=120)
        yield openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, http_client=http, max_retries=0)


async def test_openai_agents_tool_loop_on_the_default_model_reuses_its_kv(agents_sdk, real_openai):
    sdk = agents_sdk
    seen = []

    @sdk.function_tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        seen.append(city)
        return "18 C and sunny"

    agent = sdk.Agent(name="weather", instructions="Answer with the get_weather tool.", tools=[get_weather],
                      model=sdk.OpenAIChatCompletionsModel(model="default", openai_client=real_openai),
                      model_settings=sdk.ModelSettings(tool_choice="required", temperature=0, max_tokens=48))
    result = await sdk.Runner.run(agent, "What is the weather in Paris?", max_turns=4)
    assert seen and all(isinstance(city, str) and city for city in seen)
    assert isinstance(result.final_output, str) and result.final_output.strip()
    second = result.raw_responses[1].usage
    cached = second.input_tokens_details.cached_tokens
    assert cached > second.input_tokens - cached  # the history resent whole was mostly reused, not re-prefilled


async def test_pydantic_ai_responses_structured_output_on_the_default_model(real_openai):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.output import NativeOutput
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIResponsesModel("default", provider=OpenAIProvider(openai_client=real_openai))
    result = await Agent(model, output_type=NativeOutput(City)).run(
        "Paris is the capital of France. Give its city and country.",
        model_settings={"temperature": 0, "max_tokens": 48})
    assert isinstance(result.output, City) and result.output.city and result.output.country


async def test_instructor_tools_mode_on_the_default_model_gives_arguments_that_validate(real_openai):
    answer = await real_openai.chat.completions.create(
        model="default", temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": "Paris is the capital of France."}],
        tools=[{"type": "function", "function": {**instructor_tool_schema(), "name": "City",
                                                 "parameters": City.model_json_schema()}}],
        tool_choice={"type": "function", "function": {"name": "City"}})
    [tool_call] = answer.choices[0].message.tool_calls
    assert tool_call.function.name == "City" and City.model_validate_json(tool_call.function.arguments)
