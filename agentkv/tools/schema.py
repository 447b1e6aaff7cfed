"""Turn a function's signature and docstring into a pydantic arguments model and a JSON schema.

::

    def add(a: int, b: int = 0) -> int:
        '''Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        '''
        return a + b

    spec = function_schema(add)
    spec.parameters["properties"]["a"]   # {"type": "integer", "description": "The first number."}
    args, kwargs = spec.call_arguments(spec.args_model.model_validate({"a": 2}))
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, PydanticUserError, create_model
from pydantic.errors import PydanticSchemaGenerationError
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema, PydanticJsonSchemaWarning

from agentkv.chat.toolcalls import TOOL_NAME_PATTERN
from agentkv.errors import UserError
from agentkv.tools.docstrings import parse_docstring


class _ToolJsonSchema(GenerateJsonSchema):
    """Pydantic's JSON schema without per-field titles: they cost prompt tokens and say nothing."""

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False


@dataclass(frozen=True)
class FunctionSchema:
    """Everything agentkv derives from one function's signature and docstring."""

    name: str
    """The tool name the model calls."""
    description: str
    """What the tool does, for the model."""
    parameters: dict[str, Any]
    """JSON schema (an ``object``) of the arguments."""
    args_model: type[BaseModel]
    """Pydantic model that validates the arguments (extra arguments are refused)."""
    field_names: dict[str, str]
    """Parameter name → field name in ``args_model`` (they differ only for names pydantic reserves)."""
    positional_only: frozenset[str]
    """Parameters that must be passed positionally."""

    def call_arguments(self, validated: BaseModel) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` to call the function with, from validated arguments."""
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        for parameter, field_name in self.field_names.items():
            value = getattr(validated, field_name)
            if parameter in self.positional_only:
                args.append(value)
            else:
                kwargs[parameter] = value
        return tuple(args), kwargs


def function_schema(
    function: Callable[..., Any], *, name: str | None = None, description: str | None = None
) -> FunctionSchema:
    """Build the :class:`FunctionSchema` of ``function``; raise ``UserError`` on what cannot be a tool."""
    if not callable(function):
        raise UserError(
            f"@tool needs a function, got {type(function).__name__} {function!r}; "
            "decorate a def or async def, or pass name= as a keyword: @tool(name='...')"
        )
    tool_name = _tool_name(function, name)
    signature = _signature(function, tool_name)
    doc = parse_docstring(inspect.getdoc(function))
    fields: dict[str, Any] = {}
    field_names: dict[str, str] = {}
    positional_only: set[str] = set()
    for index, parameter in enumerate(signature.parameters.values()):
        _check_parameter(parameter, tool_name)
        field_name = _field_name(parameter.name, index)
        fields[field_name] = _field_definition(parameter, doc.arguments.get(parameter.name), field_name)
        field_names[parameter.name] = field_name
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            positional_only.add(parameter.name)
    args_model = _create_args_model(tool_name, fields)
    return FunctionSchema(
        name=tool_name,
        description=description if description is not None else doc.summary,
        parameters=_json_schema(args_model, tool_name),
        args_model=args_model,
        field_names=field_names,
        positional_only=frozenset(positional_only),
    )


def _tool_name(function: Callable[..., Any], name: str | None) -> str:
    """The explicit name, else the function's ``__name__``; either must suit the tool format."""
    candidate = name if name is not None else getattr(function, "__name__", None)
    if candidate is None:
        raise UserError(f"{function!r} has no __name__; give the tool one: tool(fn, name='my_tool')")
    if not TOOL_NAME_PATTERN.match(candidate):
        raise UserError(
            f"tool name {candidate!r} is not allowed; use 1-64 letters, digits, '_', '-' or '.' "
            "(pass name='...' to @tool)"
        )
    return candidate


def _signature(function: Callable[..., Any], tool_name: str) -> inspect.Signature:
    """The signature with string annotations (``from __future__ import annotations``) resolved."""
    try:
        return inspect.signature(function, eval_str=True)
    except NameError as error:
        raise UserError(
            f"the annotations of tool {tool_name!r} cannot be resolved ({error}); "
            "define the types they name at module level"
        ) from error
    except (TypeError, ValueError) as error:
        raise UserError(f"cannot read the signature of tool {tool_name!r}: {error}") from error


def _check_parameter(parameter: inspect.Parameter, tool_name: str) -> None:
    """Refuse *args, **kwargs and parameters without a type annotation."""
    if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
        stars = "*" if parameter.kind is inspect.Parameter.VAR_POSITIONAL else "**"
        raise UserError(
            f"tool {tool_name!r} takes {stars}{parameter.name}; a tool's arguments must be named "
            "and typed: replace it by explicit parameters (or one pydantic-model parameter)"
        )
    if parameter.annotation is inspect.Parameter.empty:
        raise UserError(
            f"parameter {parameter.name!r} of tool {tool_name!r} has no type annotation; "
            f"annotate it (e.g. `{parameter.name}: str`) so the model knows what to pass"
        )


def _field_name(parameter_name: str, index: int) -> str:
    """A field name pydantic accepts; names it reserves get a stand-in and keep theirs as alias."""
    if parameter_name.startswith("_") or hasattr(BaseModel, parameter_name):
        return f"argument_{index}"
    return parameter_name


def _field_definition(
    parameter: inspect.Parameter, doc_description: str | None, field_name: str
) -> tuple[Any, FieldInfo]:
    """``(annotation, FieldInfo)`` for create_model; an explicit ``Field(description=...)`` wins."""
    annotation = parameter.annotation
    if doc_description:
        annotation = _with_fallback_description(annotation, doc_description)
    default = parameter.default
    alias = parameter.name if field_name != parameter.name else None
    if isinstance(default, FieldInfo):
        if alias is not None:
            annotation = Annotated[annotation, Field(alias=alias)]
        return annotation, default
    if default is inspect.Parameter.empty:
        return annotation, Field(alias=alias)
    return annotation, Field(default=default, alias=alias)


def _with_fallback_description(annotation: Any, description: str) -> Any:
    """``Annotated[annotation, Field(description=...)]`` placed before any metadata the user wrote."""
    if get_origin(annotation) is Annotated:
        base, *metadata = get_args(annotation)
        return Annotated[(base, Field(description=description), *metadata)]
    return Annotated[annotation, Field(description=description)]


def _create_args_model(tool_name: str, fields: dict[str, Any]) -> type[BaseModel]:
    """The pydantic model of the arguments; types pydantic cannot validate are a UserError."""
    config = ConfigDict(extra="forbid", protected_namespaces=())
    try:
        return create_model(f"{tool_name}_arguments", __config__=config, **fields)
    except (PydanticSchemaGenerationError, PydanticUserError, TypeError) as error:
        raise UserError(
            f"tool {tool_name!r} has a parameter type pydantic cannot validate ({error}); "
            "use JSON-friendly types (str, int, float, bool, list, dict, Literal, Enum) "
            "or pydantic models"
        ) from error


def _json_schema(args_model: type[BaseModel], tool_name: str) -> dict[str, Any]:
    """The arguments' JSON schema, without titles on the object and its fields."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PydanticJsonSchemaWarning)
            schema = args_model.model_json_schema(schema_generator=_ToolJsonSchema)
    except (PydanticUserError, PydanticJsonSchemaWarning) as error:
        raise UserError(
            f"tool {tool_name!r} cannot be described as JSON schema ({error}); "
            "give parameters JSON-friendly types and JSON-serialisable defaults"
        ) from error
    schema.pop("title", None)
    return schema
