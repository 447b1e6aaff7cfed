"""The call grammar of raw-schema tools (``tool(dict)``, the server's ``tools``) and ``@tool``s:
arguments hold the declared keys only, what a schema allows beyond them is bounded — walked
token by token through llguidance masks built from the default model's vocabulary."""

from __future__ import annotations

import json

import pytest

from agentkv import tool
from agentkv.chat.grammar_schema import MAX_KEY_LENGTH, bounded_schema
from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import format_tool_calls, tool_call_grammar
from agentkv.engine.decode.constraints import ConstraintFactory
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.tokenizer import OVTokenizer

EOS = 2
DISTANCE = {"type": "function", "function": {"name": "geo.distance", "description": "Distance between two cities.",
            "parameters": {"type": "object", "required": ["start", "end"], "properties": {
                "start": {"type": "string"}, "end": {"type": "string"},
                "options": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["km", "mi"]}}},
            }}}}
TAGS = {"type": "function", "function": {"name": "tag", "parameters": {"type": "object", "properties": {
    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
    "note": {"description": "anything"},
}}}}


@pytest.fixture(scope="module")
def tokenizer() -> OVTokenizer:
    return OVTokenizer(resolve_model(None).ir_dir)


@pytest.fixture(scope="module")
def factory(tokenizer) -> ConstraintFactory:
    meta = resolve_model(None).gguf_metadata()
    return ConstraintFactory(meta["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=49152,
                             token_types=meta["tokenizer.ggml.token_type"], encode=tokenizer.encode)


def accepts(factory, tokenizer, tools, name: str, arguments: dict) -> bool:
    """True if the "required" grammar of ``tools`` takes this one call, then EOS."""
    constraint = factory(tool_call_grammar(tools, "required"))
    for token in tokenizer.encode(format_tool_calls([ToolCall(name=name, arguments=arguments)])) + [EOS]:
        if not constraint.allowed_mask()[token]:
            return False
        constraint.advance(token)
    return True


def test_a_raw_schema_call_takes_its_declared_arguments(factory, tokenizer):
    assert accepts(factory, tokenizer, [DISTANCE], "geo.distance", {"start": "Boston", "end": "Paris"})
    assert accepts(factory, tokenizer, [DISTANCE], "geo.distance",
                   {"start": "Rome", "end": "Oslo", "options": {"unit": "km"}})


@pytest.mark.parametrize("arguments", [
    {"start": "Boston", "end": "Paris", "type": "string"},               # a key copied from the schema
    {"start": "Boston", "end": "Paris", "properties": {}},
    {"start": "Boston", "end": "Paris", "options": {"unit": "km", "description": "x"}},  # nested
])
def test_a_raw_schema_call_cannot_add_keys_its_schema_does_not_declare(factory, tokenizer, arguments):
    assert not accepts(factory, tokenizer, [DISTANCE], "geo.distance", arguments)


def test_a_map_the_schema_allows_takes_keys_but_a_bounded_number_of_bounded_ones(factory, tokenizer):
    assert accepts(factory, tokenizer, [TAGS], "tag", {"labels": {"color": "red", "size": "L"}, "note": 3})
    too_many = {f"k{i}": "v" for i in range(17)}  # the default bound: 16 keys
    assert not accepts(factory, tokenizer, [TAGS], "tag", {"labels": too_many})
    assert not accepts(factory, tokenizer, [TAGS], "tag", {"labels": {"x" * (MAX_KEY_LENGTH + 1): "v"}})
    assert not accepts(factory, tokenizer, [TAGS], "tag", {"labels": {"color": "r" * 201}})
    assert not accepts(factory, tokenizer, [TAGS], "tag", {"note": "n" * 201})


def test_a_decorated_tool_and_the_raw_schema_of_the_same_arguments_get_one_call_schema():
    @tool(name="geo.distance")
    def distance(start: str, end: str) -> str:
        """Distance between two cities."""
        return "0 km"

    raw = {"type": "object", "properties": {"start": {"type": "string"}, "end": {"type": "string"}},
           "required": ["start", "end"]}
    assert bounded_schema(distance.parameters) == bounded_schema(raw)
    assert json.dumps(bounded_schema(raw)) == json.dumps(bounded_schema(json.loads(json.dumps(raw))))


def test_an_integer_argument_cannot_run_on_for_ever(factory, tokenizer):
    counter = {"type": "function", "function": {"name": "count", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "ratio": {"type": "number"}}}}}
    assert accepts(factory, tokenizer, [counter], "count", {"n": 2**53 - 1, "ratio": -12.5})
    assert not accepts(factory, tokenizer, [counter], "count", {"n": int("1" * 20)})
    assert not accepts(factory, tokenizer, [counter], "count", {"ratio": int("1" * 20)})
