"""ChatCompletions: ``/v1/chat/completions`` on the Python API — a request becomes an ``Agent``
(its system message, tools, tool choice, response format, sampling) and a ``Conversation`` over
the live KV session that shares the longest prefix with it; the run's result becomes the
completion.

Every tool in a request is executed by the client (``tool(dict)``): a run that calls one ends
with ``finish_reason="tool_calls"`` and the client sends the results in its next request::

    service = ChatCompletions(runtime, LiveSessions(engine), model_id="SmolLM2-135M-Instruct")
    body = await service.complete(ChatCompletionRequest.model_validate(payload))
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from agentkv.agent import Agent
from agentkv.chat.messages import Message
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.conversation import Conversation, WindowEntry, render_for
from agentkv.errors import ContextOverflowError, UserError
from agentkv.events import RunFinished, TextDelta
from agentkv.result import RunResult
from agentkv.runtime import Runtime
from agentkv.server.errors import ApiError
from agentkv.server.live_sessions import LiveSessions
from agentkv.server.wire import ChatCompletionRequest, FinishReason, chunk, completion, tool_call_dicts, usage

KEPT_AGENTS = 256
"""Request agents (system prompt + tools + format) kept, with their shared prefix registered."""


@dataclass
class Prepared:
    """A request read into what a run needs."""

    salt: str
    """The tenant: cached prefixes and live sessions are shared within it only."""
    agent: Agent
    history: list[Message]
    tail: list[Message]
    prompt_ids: tuple[int, ...]


class ChatCompletions:
    """Serves chat completions on one runtime. See the module docstring for a call."""

    def __init__(self, runtime: Runtime, live: LiveSessions, *, model_id: str, max_running: int = 64) -> None:
        self.runtime = runtime
        self.live = live
        self.model_id = model_id
        self.max_running = max_running
        self.running = 0
        self._agents: OrderedDict[str, Agent] = OrderedDict()
        self._registered: OrderedDict[tuple[str, str], None] = OrderedDict()

    # ---- the request, read --------------------------------------------------------------
    def prepare(self, request: ChatCompletionRequest, *, tenant: str = "") -> Prepared:
        """The agent, history and new messages of ``request`` for ``tenant`` (the API key's
        namespace); ``UserError`` / ``ValueError`` (400) or ``ContextOverflowError`` (413) before
        anything runs."""
        salt = tenant if request.cache_salt is None else f"{tenant}/{request.cache_salt}"
        messages = messages_from_openai(request.messages)
        system = []
        while messages and messages[0].role == "system":
            system.append(messages.pop(0).content)
        if any(m.role == "system" for m in messages):
            raise UserError("system (or developer) messages must come first, before the conversation")
        last_answer = max((i for i, m in enumerate(messages) if m.role == "assistant"), default=-1)
        history, tail = messages[: last_answer + 1], messages[last_answer + 1:]
        if not tail:
            raise UserError("the last message must be a user message or tool results for the model to answer")
        agent = dataclasses.replace(self._agent(request, "\n\n".join(system) if system else None, salt),
                                    generation=request.generation_config())
        history = self.live.with_token_ids(history)
        prompt = render_for(self.runtime.renderer, agent, [*history, *tail]).token_ids
        limit = agent.prompt_budget(self.runtime.engine.max_context_len)
        if len(prompt) > limit:
            raise ContextOverflowError(
                f"the messages need {len(prompt)} tokens, over the {limit} this model's context leaves "
                f"({agent.min_response_len} kept for the answer); send a shorter history",
                prompt_tokens=len(prompt), limit=limit)
        return Prepared(salt, agent, history, tail, tuple(prompt))

    def _agent(self, request: ChatCompletionRequest, instructions: str | None, salt: str) -> Agent:
        """The agent for this system prompt, tools and format (made once), its prefix registered
        for tenant ``salt``."""
        choice = request.tool_choice_name()
        output = request.response_format if (request.response_format or {}).get("type") not in (None, "text") else None
        key_source = json.dumps([instructions, request.tools, choice, request.parallel_tool_calls, output],
                                sort_keys=True, default=str)
        key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
        agent = self._agents.get(key)
        if agent is None:
            agent = Agent(name=f"api-{key}", instructions=instructions, tools=tuple(request.tools or ()),
                          tool_choice=choice, parallel_tool_calls=request.parallel_tool_calls is not False,
                          output_type=output, max_turns=2)
            self._agents[key] = agent
            while len(self._agents) > KEPT_AGENTS:
                self._agents.popitem(last=False)
        self._agents.move_to_end(key)
        if (key, salt) not in self._registered:
            self.runtime.register_agent_prefix(agent, salt=salt)
            self._registered[(key, salt)] = None
            while len(self._registered) > KEPT_AGENTS:
                self._registered.popitem(last=False)
        return agent

    # ---- running ------------------------------------------------------------------------
    async def events(self, prepared: Prepared, pin: str | None) -> AsyncIterator[TextDelta | RunResult]:
        """Text as it is generated, then the run's result (the KV session is held throughout)."""
        self._admit()
        try:
            async with self.live.checkout(prepared.prompt_ids, pin=pin, salt=prepared.salt) as kv:
                conversation = Conversation(f"api-{uuid.uuid4().hex[:12]}", prepared.agent, self.runtime.engine, kv,
                                            self.runtime.renderer, window=[WindowEntry(m) for m in prepared.history])
                async with aclosing(self.runtime.run_stream(conversation, prepared.tail)) as run:
                    async for event in run:
                        if isinstance(event, TextDelta):
                            yield event
                        elif isinstance(event, RunFinished):
                            for message in event.result.new_messages:
                                if message.role == "assistant":
                                    self.live.remember(message)
                            yield event.result
        finally:
            self.running -= 1

    def _admit(self) -> None:
        if self.running >= self.max_running:
            raise ApiError(429, f"the server is busy: {self.running} requests are running; retry later",
                           "rate_limit_exceeded")
        self.running += 1

    async def complete(self, request: ChatCompletionRequest, *, pin: str | None = None,
                       tenant: str = "") -> dict[str, Any]:
        """The ``chat.completion`` object for ``request``."""
        prepared = self.prepare(request, tenant=tenant)
        result = None
        async for event in self.events(prepared, pin):
            if isinstance(event, RunResult):
                result = event
        assert result is not None
        return completion(_request_id(), self.model_id, int(time.time()), _message(result), _finish(result),
                          _usage(result))

    async def stream(self, request: ChatCompletionRequest, prepared: Prepared, *,
                     pin: str | None = None) -> AsyncIterator[dict[str, Any]]:
        """The ``chat.completion.chunk`` objects of ``request`` (run already ``prepare``d)."""
        request_id, created = _request_id(), int(time.time())
        yield chunk(request_id, self.model_id, created, {"role": "assistant", "content": ""})
        result = None
        async for event in self.events(prepared, pin):
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
            yield chunk(request_id, self.model_id, created, {}, usage_=_usage(result))


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


def _usage(result: RunResult) -> dict[str, Any]:
    first = result.step_metrics[0] if result.step_metrics else None
    return usage(first, sum(m.generated_tokens for m in result.step_metrics))
