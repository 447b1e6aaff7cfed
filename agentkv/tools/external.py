"""Tools the caller executes: a raw OpenAI-format schema, no function behind it.

A run whose model calls such a tool stops with ``finish_reason="tool_calls"`` and the calls in
``RunResult.pending_tool_calls``; the caller runs them and continues the run with the results::

    weather = tool({"type": "function", "function": {"name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
    agent = Agent(name="a", tools=[weather])
    result = await runtime.run(session, "Weather in Paris?")          # finish_reason "tool_calls"
    call = result.pending_tool_calls[0]
    result = await runtime.run(session, [{"role": "tool", "tool_call_id": call.id, "content": "18 C"}])

Both OpenAI layouts are accepted: chat completions' ``{"type": "function", "function": {...}}``
and the Responses API's flat ``{"type": "function", "name": ..., "parameters": ...}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, create_model, field_validator

from agentkv.chat.toolcalls import TOOL_NAME_PATTERN
from agentkv.errors import UserError
from agentkv.tools.schema import FunctionSchema
from agentkv.validation_text import describe_problems

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class FunctionSpec(BaseModel):
    """An OpenAI function definition."""

    model_config = ConfigDict(extra="forbid")

    name: str
    description: str = ""
    parameters: dict[str, Any] = EMPTY_PARAMETERS
    strict: bool | None = None
    """Accepted for compatibility; calls are always decoded under the schema's grammar, as strict
    mode would: objects take only their declared keys unless the schema allows more, and strings,
    arrays and maps are bounded (``agentkv.chat.grammar_schema``)."""

    @field_validator("name")
    @classmethod
    def _name_the_format_can_carry(cls, name: str) -> str:
        if not TOOL_NAME_PATTERN.match(name):
            raise ValueError(f"tool name {name!r} is not allowed: use 1-64 letters, digits, '_', '-' or '.'")
        return name

    @field_validator("parameters")
    @classmethod
    def _an_object_schema(cls, parameters: dict[str, Any]) -> dict[str, Any]:
        if parameters.get("type", "object") != "object":
            raise ValueError(f'parameters must be a JSON schema of type "object", got type {parameters.get("type")!r}')
        if not isinstance(parameters.get("properties", {}), dict):
            raise ValueError("parameters.properties must be an object mapping argument names to schemas")
        return {"type": "object", **parameters}


class ChatToolSpec(BaseModel):
    """``{"type": "function", "function": {...}}`` (chat completions)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionSpec


def parse_tool_spec(schema: Mapping[str, Any]) -> FunctionSpec:
    """The function definition in ``schema`` (either OpenAI layout); ``UserError`` says what is wrong."""
    if not isinstance(schema, Mapping):
        raise UserError(f"a tool schema must be a dict in OpenAI function format, got {type(schema).__name__}")
    try:
        if "function" in schema:
            return ChatToolSpec.model_validate(dict(schema)).function
        flat = dict(schema)
        if flat.pop("type", "function") != "function":
            raise UserError(f'only "function" tools are supported, got type {schema.get("type")!r}')
        return FunctionSpec.model_validate(flat)
    except ValidationError as error:
        problems = describe_problems(error.errors(), root="schema")
        raise UserError(
            f"not a tool schema in OpenAI function format ({problems}); expected "
            '{"type": "function", "function": {"name": ..., "description": ..., "parameters": {...}}}'
        ) from error


def external_schema(schema: Mapping[str, Any]) -> FunctionSchema:
    """The ``FunctionSchema`` of a caller-executed tool (its arguments are not validated here:
    the call was decoded under the schema's grammar, and the caller reads them)."""
    spec = parse_tool_spec(schema)
    args_model = create_model(f"{spec.name.replace('.', '_').replace('-', '_')}_arguments",
                              __config__=ConfigDict(extra="allow"))
    return FunctionSchema(name=spec.name, description=spec.description, parameters=spec.parameters,
                          args_model=args_model, field_names={}, positional_only=frozenset())
