"""The OpenAI chat-completions wire format: the request as our pydantic model validates it (we
accept what clients send), and the response and stream chunks built with the ``openai`` package's
own types (``ChatCompletion``, ``ChatCompletionChunk``, ``CompletionUsage``), sent as JSON dicts.

::

    request = ChatCompletionRequest.model_validate(body)
    config = request.generation_config(defaults)
    completion(request_id, model, created, message, "stop", usage(counts))
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from openai.types.chat import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionTokenLogprob,
)
from openai.types.chat.chat_completion import Choice, ChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import Function
from openai.types.completion_usage import CompletionUsage, PromptTokensDetails
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from agentkv.observe.cache_breaks import CacheBreak
from agentkv.chat.messages import ToolCall
from agentkv.engine.base import MAX_LOGPROBS, GenerationConfig
from agentkv.engine.generation import GenerationMetrics
from agentkv.server.request_agents import AgentDefaults


class StreamOptions(BaseModel):
    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    """``POST /v1/chat/completions``. Fields OpenAI defines that change nothing here (``metadata``…)
    are accepted and ignored; ones that would change the answer, or ask for what is not
    supported (``n`` > 1), are refused."""

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
    logprobs: bool | None = None
    """Return each answer token's log-probability (``choices[].logprobs.content``)."""
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """With ``logprobs``: this many most likely alternatives per token (0..20)."""

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: send logprobs=true with it (or drop top_logprobs)")
        return value

    def logprob_count(self) -> int | None:
        """Alternatives per token for ``GenerationConfig.logprobs`` (None: log-probabilities off)."""
        return (self.top_logprobs or 0) if self.logprobs else None

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

    def generation_config(self, defaults: AgentDefaults) -> GenerationConfig:
        """The sampling settings of the request (the server's defaults where it sets none)."""
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return sampling(defaults, max_tokens=self.max_completion_tokens or self.max_tokens,
                        temperature=self.temperature, top_p=self.top_p, seed=self.seed, stop_strings=stops,
                        presence_penalty=self.presence_penalty or 0.0,
                        frequency_penalty=self.frequency_penalty or 0.0, logprobs=self.logprob_count())

    def tool_choice_name(self) -> str:
        """``tool_choice`` as an ``Agent`` takes it: auto / none / required / a tool's name."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            if not isinstance(function, dict) or not isinstance(function.get("name"), str):
                raise ValueError('tool_choice as an object is {"type": "function", "function": {"name": ...}}')
            return str(function["name"])
        return tool_choice_name(choice)


def tool_choice_name(choice: str | None) -> str:
    """A ``tool_choice`` string checked: auto (also for None) / none / required."""
    if choice is None:
        return "auto"
    if choice not in ("auto", "none", "required"):
        raise ValueError(f'tool_choice must be "auto", "none", "required" or a function, got {choice!r}')
    return choice


def sampling(defaults: AgentDefaults, *, max_tokens: int | None, temperature: float | None, top_p: float | None,
             **fields: Any) -> GenerationConfig:
    """A request's ``GenerationConfig``: its own values, else the server's defaults."""
    return GenerationConfig(
        max_new_tokens=max_tokens or defaults.max_new_tokens,
        temperature=defaults.temperature if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        **fields,
    )


def tool_calls(calls: tuple[ToolCall, ...]) -> list[ChatCompletionMessageFunctionToolCall]:
    """Calls as the ``tool_calls`` of an OpenAI assistant message::

        ChatCompletionMessage(role="assistant", content=None, tool_calls=tool_calls(result.pending_tool_calls))
    """
    return [ChatCompletionMessageFunctionToolCall(id=call.id, type="function", function=Function(
        name=call.name, arguments=json.dumps(call.arguments))) for call in calls]


def delta_tool_calls(calls: tuple[ToolCall, ...]) -> list[ChoiceDeltaToolCall]:
    """Calls as the ``tool_calls`` of a stream delta (each whole, with its ``index``)::

        ChoiceDelta(tool_calls=delta_tool_calls(result.pending_tool_calls))
    """
    return [ChoiceDeltaToolCall(index=index, id=call.id, type="function", function=ChoiceDeltaToolCallFunction(
        name=call.name, arguments=json.dumps(call.arguments))) for index, call in enumerate(calls)]


@dataclass(frozen=True)
class TokenCounts:
    """A run's tokens over all its model calls: prompt, reused (KV the session held or the
    prefix cache shared instead of computing it) and generated."""

    prompt: int
    cached: int
    generated: int

    @classmethod
    def of(cls, steps: Sequence[GenerationMetrics]) -> TokenCounts:
        return cls(prompt=sum(m.prompt_tokens for m in steps),
                   cached=sum(m.reused_tokens + m.prefix_cache_tokens for m in steps),
                   generated=sum(m.generated_tokens for m in steps))


def usage(counts: TokenCounts) -> CompletionUsage:
    """Chat ``usage`` with ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV was
    reused instead of computed::

        usage(TokenCounts.of(result.call_metrics)).prompt_tokens_details
    """
    return CompletionUsage(prompt_tokens=counts.prompt, completion_tokens=counts.generated,
                           total_tokens=counts.prompt + counts.generated,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=counts.cached))


def cache_break_field(breaks: Sequence[CacheBreak | None]) -> dict[str, Any]:
    """The ``agentkv`` extension field: the first model call that reused less KV than its
    session held — where, in what and why (``agentkv.observe.cache_breaks``) — or None."""
    found = next((b for b in breaks if b is not None), None)
    if found is None:
        return {"cache_break": None}
    return {"cache_break": found.as_json()}


FinishReason = Literal["stop", "length", "tool_calls"]


def as_wire(model: BaseModel) -> dict[str, Any]:
    """An openai wire object as JSON-ready dict: exactly the fields it was given (a field set to
    None is sent as null; one never set is left out)::

        as_wire(CompletionUsage(prompt_tokens=5, completion_tokens=2, total_tokens=7))
    """
    return model.model_dump(mode="json", exclude_unset=True)


def completion(request_id: str, model: str, created: int, message: ChatCompletionMessage, finish: FinishReason,
               usage_: CompletionUsage, extension: dict[str, Any] | None = None,
               logprobs: list[ChatCompletionTokenLogprob] | None = None) -> dict[str, Any]:
    """A ``chat.completion`` object with one choice (and agentkv's ``extension`` field);
    ``logprobs`` the answer's ``token_logprobs`` when the request asked for them."""
    body = as_wire(ChatCompletion(id=request_id, object="chat.completion", created=created, model=model,
                                  choices=[Choice(index=0, message=message, finish_reason=finish,
                                                  logprobs=None if logprobs is None else
                                                  ChoiceLogprobs(content=logprobs, refusal=None))],
                                  usage=usage_))
    return {**body, "agentkv": extension} if extension is not None else body


def chunk(request_id: str, model: str, created: int, delta: ChoiceDelta, finish: FinishReason | None = None,
          usage_: CompletionUsage | None = None,
          logprobs: list[ChatCompletionTokenLogprob] | None = None) -> dict[str, Any]:
    """A ``chat.completion.chunk``; with ``usage_`` the final usage chunk (no choices);
    ``logprobs`` the ``token_logprobs`` of the tokens behind the delta's text::

        chunk("chatcmpl-1", "SmolLM2", 1700000000, ChoiceDelta(content="Hi"))
    """
    if usage_ is not None:
        return as_wire(ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created,
                                           model=model, choices=[], usage=usage_))
    choice = ChunkChoice(index=0, delta=delta, finish_reason=finish,
                         logprobs=None if logprobs is None else ChunkLogprobs(content=logprobs, refusal=None))
    return as_wire(ChatCompletionChunk(id=request_id, object="chat.completion.chunk", created=created, model=model,
                                       choices=[choice]))
