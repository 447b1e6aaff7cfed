"""Structured final output (``Agent(output_type=...)``): the answer is decoded under the schema's
grammar (with or without tools) and parsed into the model; what cannot be parsed says so."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field, field_validator

from agentkv import Agent, Runtime, tool
from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.runtime.stored_agent import agent_from_record
from agentkv.testing import ScriptedEngine


class City(BaseModel):
    name: str = Field(max_length=40)
    population: int


@tool
def lookup(city: str) -> int:
    """Population of a city."""
    return 2_100_000


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


async def run_once(agent: Agent, replies: list[str], text: str = "Largest city in France?"):
    engine = ScriptedEngine(replies)
    runtime = Runtime(engine)
    session = await runtime.open_conversation(agent)
    return engine, await runtime.run(session, text)


async def test_a_pydantic_output_type_constrains_the_answer_and_parses_it():
    engine, result = await run_once(Agent(name="geo", output_type=City), ['{"name": "Paris", "population": 2100000}'])
    assert result.finish_reason == "stop" and result.output == City(name="Paris", population=2100000)
    grammar = engine.requested_grammars[0]
    assert grammar.startswith("start: answer") and '"population"' in grammar


async def test_with_tools_the_answer_that_is_not_a_call_is_the_json_and_calls_still_run():
    agent = Agent(name="geo", tools=[lookup], output_type=City)
    engine, result = await run_once(agent, [call("lookup", city="Paris"), '{"name": "Paris", "population": 2100000}'])
    assert [c.name for c in result.tool_calls] == ["lookup"] and result.output.population == 2100000
    assert all("start: tool_calls | answer" in g for g in engine.requested_grammars)


@pytest.mark.parametrize("output_type", [
    {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]},
    {"type": "json_schema", "json_schema": {"name": "city", "schema": {"type": "object",
                                                                      "properties": {"name": {"type": "string"}}}}},
    {"type": "json_object"},
])
async def test_a_json_schema_or_an_openai_response_format_gives_a_dict(output_type):
    _, result = await run_once(Agent(name="geo", output_type=output_type), ['{"name": "Paris"}'])
    assert result.output == {"name": "Paris"}


async def test_an_answer_that_fails_validation_ends_the_run_as_output_invalid_with_no_output():
    class Positive(BaseModel):
        n: int

        @field_validator("n")
        @classmethod
        def positive(cls, n: int) -> int:
            if n <= 0:
                raise ValueError("n must be positive")
            return n

    _, result = await run_once(Agent(name="p", output_type=Positive), ['{"n": -1}'])
    assert result.finish_reason == "output_invalid" and result.output is None
    assert result.final_text == '{"n": -1}'  # the text is kept


@pytest.mark.parametrize("output_type, complaint", [
    ({"type": "bogus"}, "does not compile"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, '"schema"'),
    ({"type": "text"}, "leave output_type unset"),
    (str, "pydantic model class or a JSON schema"),
])
def test_an_output_type_that_cannot_be_a_grammar_is_refused_when_the_agent_is_made(output_type, complaint):
    with pytest.raises(UserError, match=complaint):
        Agent(name="bad", output_type=output_type)


async def test_a_stored_agent_keeps_its_output_schema(tmp_path):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshot_dir=tmp_path / "s")
    runtime = Runtime(ScriptedEngine([]), store=store)
    await runtime.open_conversation(Agent(name="geo", output_type=City))
    rebuilt = agent_from_record(await store.get_agent("geo"))
    assert rebuilt.output_spec is not None and rebuilt.output_spec.schema == City.model_json_schema()
    await runtime.aclose()
    await store.close()


