"""The OpenAI Responses wire format: the request as our pydantic model validates it, its input
items read into chat messages, and the output items, usage and ``response`` object built with the
``openai`` package's types (``ResponseOutputMessage``, ``ResponseFunctionToolCall``, ``Response``…),
sent as JSON dicts (the stream fills them in as it goes).

::

    request = ResponseRequest.model_validate(body)
    messages = request.input_messages()             # OpenAI chat dicts
    body = response_object(request, "resp_1", "SmolLM2", created, output_items, counts)
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal

from openai.types.responses import (
    Response,
    ResponseFunctionToolCall,
    ResponseFunctionToolCallOutputItem,
    ResponseOutputMessage,
    ResponseOutputText,
    ResponseReasoningItem,
    ResponseUsage,
)
from openai.types.responses.response_output_message import Content
from openai.types.responses.response_usage import InputTokensDetails, OutputTokensDetails
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentkv.chat.messages import ToolCall
from agentkv.engine.base import MAX_LOGPROBS, GenerationConfig
from agentkv.server.request_agents import AgentDefaults
from agentkv.server.wire import TokenCounts, as_wire, sampling, tool_choice_name

LOGPROBS_INCLUDE = "message.output_text.logprobs"
"""The ``include`` entry that asks for log-probabilities."""

ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]
ItemStatus = Literal["completed", "incomplete", "in_progress"]
"""An output item's status (a response can also have failed; an item cannot)."""


class ResponseRequest(BaseModel):
    """``POST /v1/responses``. Fields that change nothing here (``metadata``, ``reasoning``…) are
    accepted and ignored; ones that would and are not supported (``conversation``,
    ``background``, tools other than functions) are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_output_tokens: int | None = Field(None, ge=1)
    truncation: Literal["auto", "disabled"] | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    cache_salt: str | None = None
    """Namespaces cached prefixes within an API key, as on chat completions."""
    conversation: Any = None
    background: bool | None = None
    include: list[str] | None = None
    """``["message.output_text.logprobs"]`` returns each answer token's log-probability."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """With the logprobs ``include``: this many most likely alternatives per token (0..20)."""

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_the_include(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and LOGPROBS_INCLUDE not in (info.data.get("include") or ()):
            raise ValueError(f'top_logprobs needs include: ["{LOGPROBS_INCLUDE}"] to return log-probabilities; '
                             "add it (or drop top_logprobs)")
        return value

    @property
    def wants_logprobs(self) -> bool:
        """True when ``include`` asks for the answer's log-probabilities."""
        return LOGPROBS_INCLUDE in (self.include or ())

    @field_validator("conversation")
    @classmethod
    def _no_conversation_objects(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError("conversation objects are not supported: chain responses with previous_response_id")
        return value

    @field_validator("background")
    @classmethod
    def _not_in_background(cls, value: bool | None) -> bool | None:
        if value:
            raise ValueError("background responses are not supported: send stream=true to follow a long response")
        return value

    def function_tools(self) -> list[dict[str, Any]]:
        """The request's tools in the chat format ``tool(dict)`` takes; ``ValueError`` for a
        tool type other than ``function``."""
        out = []
        for index, item in enumerate(self.tools or ()):
            if item.get("type") != "function":
                raise ValueError(f"tools[{index}]: only function tools are supported here, got "
                                 f"type {item.get('type')!r}")
            function = {k: item[k] for k in ("name", "description", "parameters", "strict") if k in item}
            out.append({"type": "function", "function": function})
        return out

    def tool_choice_name(self) -> str:
        """``tool_choice`` as an ``Agent`` takes it (``{"type": "function", "name": ...}`` → the name)."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError('tool_choice as an object is {"type": "function", "name": ...}')
            return str(choice["name"])
        return tool_choice_name(choice)

    def output_format(self) -> dict[str, Any] | None:
        """``text.format`` as a chat ``response_format`` (None for plain text)."""
        format_ = (self.text or {}).get("format") or {"type": "text"}
        kind = format_.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "json_object"}
        if kind == "json_schema":
            if not isinstance(format_.get("schema"), dict):
                raise ValueError('text.format json_schema needs a "schema" object')
            schema = {k: format_[k] for k in ("name", "schema", "strict", "description") if k in format_}
            return {"type": "json_schema", "json_schema": schema}
        raise ValueError(f'text.format.type must be "text", "json_object" or "json_schema", got {kind!r}')

    def generation_config(self, defaults: AgentDefaults) -> GenerationConfig:
        """The sampling settings of the request (the server's defaults where it sets none)."""
        return sampling(defaults, max_tokens=self.max_output_tokens, temperature=self.temperature, top_p=self.top_p,
                        logprobs=(self.top_logprobs or 0) if self.wants_logprobs else None)

    def input_messages(self) -> list[dict[str, Any]]:
        """``input`` as OpenAI chat messages: a string is a user message; message items keep
        their role, ``function_call`` items join the assistant turn before them (an assistant message
        between them and their outputs is that turn's text, as the server emits and clients replay
        it) and ``function_call_output`` items become tool messages. ``ValueError`` names a bad item."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        messages: list[dict[str, Any]] = []
        for index, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message":
                content = _text_content(index, item.get("content"))
                last = messages[-1] if messages else None
                if item.get("role") == "assistant" and last is not None and (_calls_without_text(last)
                                                                             or _thinking_only(last)):
                    last["content"] = content  # NOTE: the text of the step that made those calls (any order)
                else:
                    messages.append({"role": item.get("role"), "content": content})
            elif kind == "function_call":
                call = {"id": item.get("call_id"), "type": "function",
                        "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"}}
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif kind == "reasoning":  # NOTE: the thinking of the assistant turn that follows
                messages.append({"role": "assistant", "content": None, "reasoning_content": _reasoning_text(item)})
            elif kind == "function_call_output":
                output = item.get("output")
                messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                 "content": output if isinstance(output, str) else json.dumps(output)})
            else:
                raise ValueError(f"input[{index}]: items of type {kind!r} are not supported (message, "
                                 "reasoning, function_call and function_call_output are)")
        if not messages:
            raise ValueError("input is empty: send a string or at least one message")
        return messages


def _calls_without_text(message: dict[str, Any]) -> bool:
    """An assistant turn made of function calls only, so far: a message item that follows them
    before their outputs is the text the model wrote in the same step."""
    return message["role"] == "assistant" and bool(message.get("tool_calls")) and not message.get("content")


def _thinking_only(message: dict[str, Any]) -> bool:
    """An assistant turn holding only the thinking of a ``reasoning`` item, so far."""
    return message["role"] == "assistant" and "reasoning_content" in message and not message.get("content") \
        and not message.get("tool_calls")


def _reasoning_text(item: dict[str, Any]) -> str:
    """The thinking a ``reasoning`` input item carries: its ``reasoning_text`` parts (else its
    summary's texts), joined."""
    parts = item.get("content") or item.get("summary") or []
    return "".join(str(part.get("text", "")) for part in parts if isinstance(part, dict))


def _text_content(index: int, content: Any) -> Any:
    """A message item's content, with text parts only (``ValueError`` for images and files)."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text"):
                raise ValueError(f"input[{index}]: content parts of type {kind!r} are not supported (text only)")
    return content


def new_id(prefix: str) -> str:
    """A fresh item or response id: ``resp_…``, ``msg_…``, ``fc_…``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(item_id: str, text: str, status: ItemStatus = "completed") -> dict[str, Any]:
    """An assistant ``message`` output item with one ``output_text`` part (none while in progress)."""
    content: list[Content] = [_output_text(text)] if status != "in_progress" else []
    return as_wire(ResponseOutputMessage(type="message", id=item_id, status=status, role="assistant",
                                         content=content))


def reasoning_item(item_id: str, text: str, status: ItemStatus = "completed") -> dict[str, Any]:
    """A ``reasoning`` output item: a reasoning model's thinking as one ``reasoning_text`` part
    (none while in progress), no summary: ``reasoning_item("rs_1", "plan")``."""
    content = [{"type": "reasoning_text", "text": text}] if status != "in_progress" else []
    return as_wire(ResponseReasoningItem.model_validate({"type": "reasoning", "id": item_id, "summary": [],
                                                         "content": content, "status": status}))


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """An ``output_text`` part (``logprobs``: its tokens' ``logprob_entries``, when asked for)."""
    return as_wire(_output_text(text, logprobs))


def _output_text(text: str, logprobs: list[dict[str, Any]] | None = None) -> ResponseOutputText:
    return ResponseOutputText.model_validate({"type": "output_text", "text": text, "annotations": [],
                                              "logprobs": logprobs or []})


def function_call_item(item_id: str, call: ToolCall, status: ItemStatus = "completed") -> dict[str, Any]:
    """A ``function_call`` output item (arguments as a JSON string)."""
    return as_wire(ResponseFunctionToolCall(type="function_call", id=item_id, call_id=call.id, name=call.name,
                                            arguments=json.dumps(call.arguments), status=status))


def function_output_item(item_id: str, call_id: str, output: str) -> dict[str, Any]:
    """A ``function_call_output`` item: the result of a tool the server ran."""
    return as_wire(ResponseFunctionToolCallOutputItem(type="function_call_output", id=item_id, call_id=call_id,
                                                      output=output, status="completed"))


def response_usage(counts: TokenCounts) -> dict[str, Any]:
    """Responses ``usage``: ``input_tokens_details.cached_tokens`` are input tokens whose KV was
    reused; the rest were prefilled (written to the session's KV: ``cache_write_tokens``, an
    extension field the openai type keeps)."""
    details = InputTokensDetails.model_validate({"cached_tokens": counts.cached,
                                                 "cache_write_tokens": counts.prompt - counts.cached})
    return as_wire(ResponseUsage(input_tokens=counts.prompt, input_tokens_details=details,
                                 output_tokens=counts.generated,
                                 output_tokens_details=OutputTokensDetails(reasoning_tokens=0),
                                 total_tokens=counts.prompt + counts.generated))


def response_object(request: ResponseRequest, response_id: str, model: str, created: int,
                    output: list[dict[str, Any]], *, status: ResponseStatus = "completed",
                    incomplete_reason: str | None = None, usage: dict[str, Any] | None = None,
                    error: dict[str, str] | None = None) -> dict[str, Any]:
    """The ``response`` object (what ``GET /v1/responses/{id}`` returns later), checked by the
    openai package's ``Response``; ``error`` the ``{"code", "message"}`` of a failed one."""
    checked = as_wire(Response.model_validate({
        "id": response_id, "object": "response", "created_at": created, "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete_reason} if incomplete_reason else None,
        "instructions": request.instructions, "max_output_tokens": request.max_output_tokens,
        "model": model, "output": output,
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "store": request.store, "temperature": request.temperature, "top_p": request.top_p,
        "tool_choice": "auto", "tools": [],
        "truncation": request.truncation or "disabled", "user": request.user,
        "metadata": request.metadata or {}, "usage": usage,
    }))
    # NOTE: the request's own settings are echoed as the client sent them (we accept what clients
    # send, the openai type may not: a json_schema format without a name); created_at in whole
    # seconds, as the API sends it (the openai type holds a float)
    return {**checked, "created_at": created, "text": request.text or {"format": {"type": "text"}},
            "tool_choice": request.tool_choice or "auto", "tools": request.tools or []}
