"""Structured final output: an agent's ``output_type`` (a pydantic model or a JSON schema) as the
schema its answers are decoded under and the object they are parsed into.

::

    class City(BaseModel):
        name: str
        population: int

    agent = Agent(name="geo", output_type=City)
    result = await runtime.run(session, "The largest city in France?")
    result.output          # City(name="Paris", population=2102650)

A JSON schema (``{"type": "object", ...}``) or an OpenAI ``response_format``
(``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}`` or
``{"type": "json_object"}``) gives a dict instead. The answer is decoded under the schema with
llguidance, so it is JSON that fits it; a model that still fails validation (a pydantic
validator the schema cannot express, an answer cut by ``max_new_tokens``) ends the run with
``finish_reason="output_invalid"`` / ``"length"`` and ``output=None``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ValidationError

from agentkv.chat.toolcalls import answer_grammar
from agentkv.errors import UserError

class OutputInvalid(ValueError):
    """The final answer does not validate against the agent's ``output_type``."""


@dataclass(frozen=True)
class OutputSpec:
    """What an ``output_type`` asks for."""

    schema: dict[str, Any]
    """The JSON schema the answer is decoded under."""
    model: type[BaseModel] | None = None
    """The pydantic model answers are parsed into (None: a dict)."""

    @classmethod
    def of(cls, output_type: Any) -> OutputSpec:
        """The spec of a pydantic model class, a JSON schema or an OpenAI ``response_format``;
        ``UserError`` says what is wrong (the schema is compiled by llguidance here)."""
        if isinstance(output_type, type) and issubclass(output_type, BaseModel):
            spec = cls(output_type.model_json_schema(), output_type)
        elif isinstance(output_type, Mapping):
            spec = cls(_schema_of(dict(output_type)))
        else:
            raise UserError(f"output_type must be a pydantic model class or a JSON schema dict, got {output_type!r}")
        problem = _grammar_problem(answer_grammar(spec.schema))
        if problem:
            raise UserError(f"output_type's JSON schema does not compile: {problem.strip()}")
        return spec

    def parse(self, text: str) -> Any:
        """The answer as the model (or a dict); ``OutputInvalid`` with the reason otherwise."""
        try:
            if self.model is not None:
                return self.model.model_validate_json(text)
            return json.loads(text)
        except (ValidationError, ValueError) as error:
            raise OutputInvalid(f"the answer does not fit the output type: {error}") from error


def _schema_of(value: dict[str, Any]) -> dict[str, Any]:
    """The JSON schema in a schema dict or an OpenAI ``response_format``."""
    kind = value.get("type")
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        inner = value.get("json_schema")
        if not isinstance(inner, Mapping) or not isinstance(inner.get("schema"), Mapping):
            raise UserError('a "json_schema" response_format needs {"json_schema": {"name": ..., "schema": {...}}}')
        return dict(inner["schema"])
    if kind == "text":
        raise UserError('response_format {"type": "text"} is the default: leave output_type unset')
    return value


def _grammar_problem(grammar: str) -> str:
    import llguidance

    return str(llguidance.LLMatcher.validate_grammar(grammar))
