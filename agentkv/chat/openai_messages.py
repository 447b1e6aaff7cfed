"""OpenAI chat messages (dicts, as clients send them) read into ``Message``s.

``Message.to_openai()`` goes the other way. Accepted: ``system`` / ``developer`` / ``user``
with string content or a list of text parts, ``assistant`` with ``content: None`` and
``tool_calls`` (arguments as a JSON string), ``tool`` with ``tool_call_id``::

    messages_from_openai([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ])
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from agentkv.chat.messages import Message, ToolCall
from agentkv.errors import UserError
from agentkv.validation_text import describe_problems


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "input_text", "output_text"]
    text: str


Content = Union[str, list[TextPart], None]


class _Function(BaseModel):
    name: str
    arguments: str = "{}"


class _ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str
    type: Literal["function"] = "function"
    function: _Function


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, refusal, audio…: not carried


class _System(_Base):
    role: Literal["system", "developer"]
    content: Content


class _User(_Base):
    role: Literal["user"]
    content: Content


class _Assistant(_Base):
    role: Literal["assistant"]
    content: Content = None
    tool_calls: list[_ToolCall] = Field(default_factory=list)
    reasoning_content: str | None = None
    """A reasoning model's thinking, as vLLM and DeepSeek send it back."""


class _Tool(_Base):
    role: Literal["tool"]
    tool_call_id: str
    content: Content


_OpenAIMessage = Annotated[Union[_System, _User, _Assistant, _Tool], Field(discriminator="role")]
_ADAPTER: TypeAdapter[_OpenAIMessage] = TypeAdapter(_OpenAIMessage)


def messages_from_openai(items: Iterable[Mapping[str, Any] | Message]) -> list[Message]:
    """``Message``s from OpenAI chat message dicts (``Message``s pass through); ``UserError``
    names the message and field that is wrong. Tool results get their tool's name from the
    assistant call they answer when that call is in ``items``."""
    out: list[Message] = []
    names: dict[str, str] = {}
    for index, item in enumerate(items):
        if isinstance(item, Message):
            out.append(item)
            continue
        if not isinstance(item, Mapping):
            raise UserError(f"message {index} must be a dict in OpenAI chat format, got {type(item).__name__}")
        try:
            parsed = _ADAPTER.validate_python(dict(item))
        except ValidationError as error:
            problems = describe_problems(error.errors(), root="message")
            raise UserError(f"message {index} is not an OpenAI chat message ({problems})") from error
        out.append(_to_message(index, parsed, names))
    return out


def _to_message(index: int, parsed: Any, names: dict[str, str]) -> Message:
    text = _text(parsed.content)
    if isinstance(parsed, _System):
        return Message.system(text)
    if isinstance(parsed, _User):
        return Message.user(text)
    if isinstance(parsed, _Assistant):
        calls = []
        for call in parsed.tool_calls:
            try:
                arguments = json.loads(call.function.arguments or "{}")
            except json.JSONDecodeError as error:
                raise UserError(f"message {index}: tool call {call.id} has arguments that are not JSON "
                                f"({error.msg}); send them as a JSON object string") from error
            if not isinstance(arguments, dict):
                raise UserError(f"message {index}: tool call {call.id} arguments must be a JSON object")
            names[call.id] = call.function.name
            calls.append(ToolCall(id=call.id, name=call.function.name, arguments=arguments))
        return Message.assistant(text, tool_calls=calls, reasoning=parsed.reasoning_content)
    return Message(role="tool", content=text, tool_call_id=parsed.tool_call_id, name=names.get(parsed.tool_call_id))


def _text(content: Content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)
