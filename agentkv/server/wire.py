"""The OpenAI chat-completions wire format: the request as pydantic validates it, and the response
and stream chunks as plain dicts (exactly the fields the OpenAI spec names).

::

    request = ChatCompletionRequest.model_validate(body)
    config = request.generation_config()
    completion(request_id, model, created, message_dict, "stop", usage_dict)
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from agentkv.chat.messages import ToolCall
from agentkv.engine.base import GenerationConfig, GenerationMetrics

DEFAULT_MAX_TOKENS = 512
"""Tokens an answer may take when the request sets no ``max_tokens``."""


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. Fields OpenAI defines that change nothing here (``logprobs``
    off, ``metadata``…) are accepted and ignored; ones that would change the answer and are not
    supported (``n`` > 1) are refused."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    """Namespaces cached prefixes within an API key, as vLLM's ``cache_salt``: requests with
    different salts never share KV."""
    n: int = 1

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError("only n=1 is supported: send one request per choice")
        return n

    @field_validator("stop")
    @classmethod
    def _at_most_four_stops(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("stop takes at most 4 sequences")
        return stop

    def generation_config(self) -> GenerationConfig:
        """The sampling settings of the request (OpenAI's defaults where it sets none)."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return GenerationConfig(
            max_new_tokens=self.max_completion_tokens or self.max_tokens or DEFAULT_MAX_TOKENS,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop_strings=stops,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
        )

    def tool_choice_name(self) -> str:
        """``tool_choice`` as an ``Agent`` takes it: auto / none / required / a tool's name."""
        choice = self.tool_choice
        if choice is None:
            return "auto"
        if isinstance(choice, str):
            if choice not in ("auto", "none", "required"):
                raise ValueError(f'tool_choice must be "auto", "none", "required" or a function, got {choice!r}')
            return choice
        function = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError('tool_choice as an object is {"type": "function", "function": {"name": ...}}')
        return str(function["name"])


def tool_call_dicts(calls: tuple[ToolCall, ...], *, with_index: bool = False) -> list[dict[str, Any]]:
    """Calls as the ``tool_calls`` of an OpenAI message (or stream delta, ``with_index``)."""
    out = []
    for index, call in enumerate(calls):
        item: dict[str, Any] = {"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
        out.append({"index": index, **item} if with_index else item)
    return out


def usage(first: GenerationMetrics | None, completion_tokens: int) -> dict[str, Any]:
    """``usage`` with ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV was reused
    (held by the session or shared from the prefix cache) instead of computed."""
    prompt = first.prompt_tokens if first is not None else 0
    cached = (first.reused_tokens + first.prefix_cache_tokens) if first is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
            "total_tokens": prompt + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


FinishReason = Literal["stop", "length", "tool_calls"]


def completion(request_id: str, model: str, created: int, message: dict[str, Any], finish: FinishReason,
               usage_: dict[str, Any]) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice."""
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": finish, "logprobs": None}],
            "usage": usage_}


def chunk(request_id: str, model: str, created: int, delta: dict[str, Any], finish: FinishReason | None = None,
          usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; with ``usage_`` the final usage chunk (no choices)."""
    body: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
    if usage_ is not None:
        return {**body, "choices": [], "usage": usage_}
    return {**body, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
