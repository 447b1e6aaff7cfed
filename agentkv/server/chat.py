"""ChatCompletions: ``/v1/chat/completions`` on the Python API — a request becomes an ``Agent``
(its system message, tools, tool choice, response format, sampling) and a ``Conversation`` over
the live KV session that shares the longest prefix with it; the run's result becomes the
completion.

A reasoning model's thinking goes out as ``message.reasoning_content`` (streamed:
``delta.reasoning_content``), never in ``content`` or a call's arguments, as vLLM and DeepSeek do;
an assistant message sent back with ``reasoning_content`` keeps it (``Message.reasoning``).

Every tool in a request is executed by the client (``tool(dict)``): a run that calls one ends
with ``finish_reason="tool_calls"`` and the client sends the results in its next request::

    runtime = Runtime(engine)
    service = ChatCompletions(Runs(runtime, LiveSessions(engine)), RequestAgents([runtime]), model_id="SmolLM2")
    request = ChatCompletionRequest.model_validate(payload)
    prepared = service.prepare(request)
    conversation_id = service.route(prepared, conversation_id=None)     # echoed as X-Session-Id
    body = await service.complete(request, prepared, conversation_id=conversation_id)
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import anyio
from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion_chunk import ChoiceDelta

from agentkv.chat.openai_messages import messages_from_openai
from agentkv.engine.generation import TokenLogprob
from agentkv.events import ReasoningDelta, RunFinished, TextDelta
from agentkv.result import RunResult
from agentkv.server.access_log import AccessNote
from agentkv.server.logprobs_wire import token_logprobs
from agentkv.server.request_agents import RequestAgents, reserving_answer
from agentkv.server.runs import Prepared, Runs, kv_namespace, leading_system
from agentkv.server.stream_batches import joined_deltas, ready_batches
from agentkv.server.wire import (
    ChatCompletionRequest,
    FinishReason,
    TokenCounts,
    cache_break_field,
    chunk,
    completion,
    delta_tool_calls,
    tool_calls,
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
                                  parallel_tool_calls=request.parallel_tool_calls is not False, output=output,
                                  salt=salt)
        agent = dataclasses.replace(agent, generation=request.generation_config(self.agents.defaults))
        agent = reserving_answer(agent, request.max_completion_tokens or request.max_tokens,
                                 self.runs.runtime.engine.max_context_len,
                                 param="max_completion_tokens" if request.max_completion_tokens else "max_tokens")
        return self.runs.prepare(agent, messages, salt=salt)

    def route(self, prepared: Prepared, *, conversation_id: str | None, pin: str | None = None) -> str:
        """The id of the live KV session the request will run on: ``conversation_id`` (its
        ``X-Session-Id``) when it sent one, else the session of ``pin`` (its ``user``) or the one
        continuing its history, else a new id (``Runs.route``)."""
        return self.runs.route(prepared, conversation_id=conversation_id, pin=pin)

    async def _result(self, prepared: Prepared, conversation_id: str,
                      pin: str | None) -> AsyncGenerator[TextDelta | ReasoningDelta | RunResult, None]:
        """Text (and thinking) as it is generated, then the run's result (the KV session is held
        throughout)."""
        async with self.runs.admitted():
            async for event in self.runs.on_live_session(prepared, conversation_id, pin):
                if isinstance(event, (TextDelta, ReasoningDelta)):
                    yield event
                elif isinstance(event, RunFinished):
                    yield event.result

    async def complete(self, request: ChatCompletionRequest, prepared: Prepared, *, conversation_id: str,
                       pin: str | None = None, note: AccessNote | None = None) -> dict[str, Any]:
        """The ``chat.completion`` object for ``request`` (already ``prepare``d, on the live
        session ``conversation_id`` from ``route``; ``note``: what the access log says)."""
        request_id, note = _request_id(), note or AccessNote()
        note.update(id=request_id, conversation=conversation_id)
        result = None
        logprobs: list[TokenLogprob] = []
        async for event in self._result(prepared, conversation_id, pin):
            if isinstance(event, RunResult):
                result = event
            elif isinstance(event, TextDelta):
                logprobs.extend(event.logprobs)
        assert result is not None
        entries = token_logprobs(logprobs) if request.logprobs else None
        counts = TokenCounts.of(result.call_metrics)
        body = completion(request_id, self.model_id, int(time.time()), _message(result), _finish(result),
                          usage(counts), cache_break_field(result.cache_breaks), entries)
        note.update(cached_tokens=counts.cached, kv_from=prepared.restored_from)
        return body

    async def stream(self, request: ChatCompletionRequest, prepared: Prepared, *, conversation_id: str,
                     pin: str | None = None, note: AccessNote | None = None,
                     stop: anyio.Event | None = None) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of ``request`` (run already ``prepare``d), the first
        once its KV session is held and the run has begun; the text (or thinking) generated at once
        — a decode run's tokens, a confirmed draft's — in one chunk (what refuses it — a named session
        another request runs, a full server — is raised before any chunk). Once ``stop`` is set
        (the server is shutting down) the run is stopped at its next event and the stream ends
        with ``finish_reason="length"``: the answer was cut short (no chunk at all if it was stopped
        before its first)."""
        request_id, created = _request_id(), int(time.time())
        note = note or AccessNote()
        note.update(id=request_id, conversation=conversation_id)
        result, began = None, False
        async with aclosing(self._result(prepared, conversation_id, pin)) as run, \
                aclosing(ready_batches(run)) as batches:
            async for batch in batches:  # NOTE: the deltas ready at once (a decode run's) go in one chunk
                if stop is not None and stop.is_set():
                    break
                if not began:  # NOTE: the run holds its session: the answer exists now
                    began = True
                    yield chunk(request_id, self.model_id, created, ChoiceDelta(role="assistant", content=""))
                for event in joined_deltas(batch):
                    if isinstance(event, TextDelta):
                        entries = token_logprobs(event.logprobs) if request.logprobs else None
                        yield chunk(request_id, self.model_id, created, ChoiceDelta(content=event.text),
                                    logprobs=entries)
                    elif isinstance(event, ReasoningDelta):
                        yield chunk(request_id, self.model_id, created,
                                    ChoiceDelta.model_validate({"reasoning_content": event.text}))
                    else:
                        result = event
        if result is None:  # stopped: the server is shutting down
            if began:
                yield chunk(request_id, self.model_id, created, ChoiceDelta(), "length")
            return
        counts = TokenCounts.of(result.call_metrics)
        note.update(cached_tokens=counts.cached, kv_from=prepared.restored_from)
        if result.pending_tool_calls:
            yield chunk(request_id, self.model_id, created,
                        ChoiceDelta(tool_calls=delta_tool_calls(result.pending_tool_calls)))
        yield chunk(request_id, self.model_id, created, ChoiceDelta(), _finish(result))
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk(request_id, self.model_id, created, ChoiceDelta(), usage_=usage(counts))


def _request_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def _finish(result: RunResult) -> FinishReason:
    if result.pending_tool_calls:
        return "tool_calls"
    return "length" if result.finish_reason in ("length", "tool_call_cut") else "stop"


def _message(result: RunResult) -> ChatCompletionMessage:
    """The answer: its text (null beside tool calls when it wrote none, else at least ""), and
    the thinking before it as ``reasoning_content`` when the model wrote any."""
    thinking = {"reasoning_content": result.reasoning} if result.reasoning is not None else {}
    if result.pending_tool_calls:
        return ChatCompletionMessage.model_validate({
            "role": "assistant", "content": result.final_text or None, "refusal": None,
            "tool_calls": list(tool_calls(result.pending_tool_calls)), **thinking})
    return ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": result.final_text or "", "refusal": None, **thinking})

