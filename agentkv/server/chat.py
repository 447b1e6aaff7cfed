"""ChatCompletions: ``/v1/chat/completions`` on the Python API — a request becomes an ``Agent``
(its system message, tools, tool choice, response format, sampling) and a ``Conversation`` over
the live KV session that shares the longest prefix with it; the run's result becomes the
completion.

Every tool in a request is executed by the client (``tool(dict)``): a run that calls one ends
with ``finish_reason="tool_calls"`` and the client sends the results in its next request::

    runtime = Runtime(engine)
    service = ChatCompletions(Runs(runtime, LiveSessions(engine)), RequestAgents([runtime]), model_id="SmolLM2")
    body = await service.complete(ChatCompletionRequest.model_validate(payload))
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from agentkv.chat.openai_messages import messages_from_openai
from agentkv.events import RunFinished, TextDelta
from agentkv.result import RunResult
from agentkv.server.request_agents import RequestAgents
from agentkv.server.runs import Prepared, Runs, kv_namespace, leading_system
from agentkv.server.wire import (
    ChatCompletionRequest,
    FinishReason,
    cache_break_field,
    chunk,
    completion,
    tool_call_dicts,
    usage,
)


class ChatCompletions:
    """Serves chat completions on live KV sessions. See the module docstring for a call."""

    def __init__(self, runs: Runs, agents: RequestAgents, *, model_id: str) -> None:
        self.runs = runs
        self.agents = agents
        self.model_id = model_id

    def prepare(self, request: ChatCompletionRequest, *, tenant: str = "") -> Prepared:
        """The agent, history and new messages of ``request`` for ``tenant`` (the API key's
        namespace); ``UserError`` / ``ValueError`` (400) or ``ContextOverflowError`` (413) before
        anything runs."""
        salt = kv_namespace(tenant, request.cache_salt)
        instructions, messages = leading_system(messages_from_openai(request.messages))
        output = request.response_format if (request.response_format or {}).get("type") not in (None, "text") else None
        agent = self.agents.agent(instructions=instructions, tools=request.tools or (),
                                  tool_choice=request.tool_choice_name(),
                                  parallel_tool_calls=request.parallel_tool_calls is not False, output=output, salt=salt)
        agent = dataclasses.replace(agent, generation=request.generation_config(self.agents.defaults))
        return self.runs.prepare(agent, messages, salt=salt)

    async def _result(self, prepared: Prepared, pin: str | None) -> AsyncIterator[TextDelta | RunResult]:
        """Text as it is generated, then the run's result (the KV session is held throughout)."""
        async with self.runs.admitted():
            async for event in self.runs.on_live_session(prepared, pin):
                if isinstance(event, TextDelta):
                    yield event
                elif isinstance(event, RunFinished):
                    yield event.result

    async def complete(self, request: ChatCompletionRequest, *, pin: str | None = None,
                       tenant: str = "") -> dict[str, Any]:
        """The ``chat.completion`` object for ``request``."""
        prepared = self.prepare(request, tenant=tenant)
        result = None
        async for event in self._result(prepared, pin):
            if isinstance(event, RunResult):
                result = event
        assert result is not None
        return completion(_request_id(), self.model_id, int(time.time()), _message(result), _finish(result),
                          usage(result.step_metrics), cache_break_field(result.cache_breaks))

    async def stream(self, request: ChatCompletionRequest, prepared: Prepared, *,
                     pin: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of ``request`` (run already ``prepare``d)."""
        request_id, created = _request_id(), int(time.time())
        yield chunk(request_id, self.model_id, created, {"role": "assistant", "content": ""})
        result = None
        async for event in self._result(prepared, pin):
            if isinstance(event, TextDelta):
                yield chunk(request_id, self.model_id, created, {"content": event.text})
            else:
                result = event
        assert result is not None
        if result.pending_tool_calls:
            yield chunk(request_id, self.model_id, created,
                        {"tool_calls": tool_call_dicts(result.pending_tool_calls, with_index=True)})
        yield chunk(request_id, self.model_id, created, {}, _finish(result))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk(request_id, self.model_id, created, {}, usage_=usage(result.step_metrics))


def _request_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def _finish(result: RunResult) -> FinishReason:
    if result.pending_tool_calls:
        return "tool_calls"
    return "length" if result.finish_reason in ("length", "tool_call_cut") else "stop"


def _message(result: RunResult) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": result.final_text or None, "refusal": None}
    if result.pending_tool_calls:
        message["tool_calls"] = tool_call_dicts(result.pending_tool_calls)
    elif message["content"] is None:
        message["content"] = ""
    return message
