"""RequestAgents: the ``Agent`` a request runs as — its system prompt, tools, tool choice and output
format over the server's defaults — made once per distinct definition, its shared prefix
registered per tenant.

::

    agents = RequestAgents([runtime], AgentDefaults(instructions="Be brief."))
    agent = agents.agent(instructions=None, tools=[weather_schema], tool_choice="auto",
                         parallel_tool_calls=True, output=None, salt="tenant-a")
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cachetools import LRUCache

from agentkv.agent import Agent
from agentkv.policies.protocol import ContextPolicy
from agentkv.runtime.runtime import Runtime
from agentkv.server.errors import ApiError
from agentkv.tools import Tool, tool

KEPT_AGENTS = 256
"""Distinct request agents (system prompt + tools + format) kept, with their shared prefix registered."""
DEFAULT_MAX_TOKENS = 512
"""Tokens an answer may take when neither the request nor the server sets a limit."""
CLIENT_TOOL_TURNS = 2
"""Model calls a run may make when the client executes every tool (one answer, one retry of a cut call)."""


@dataclass(frozen=True)
class AgentDefaults:
    """What the server sets for every request (``agentkv serve``'s agent options); a request's
    own fields win: ``AgentDefaults(instructions="Be brief.", tools=(calculator,), temperature=0)``."""

    instructions: str | None = None
    """The system prompt of requests that bring none (None: the chat template's default)."""
    tools: tuple[Tool, ...] = ()
    """Tools the server executes itself, offered on every request next to the client's."""
    policy: ContextPolicy | None = None
    """What a stored conversation does when it outgrows the context (None: 413)."""
    max_prompt_len: int | None = None
    """Prompt budget in tokens (default: the model's context)."""
    max_new_tokens: int = DEFAULT_MAX_TOKENS
    """Answer length when the request sets no ``max_tokens``."""
    temperature: float = 1.0
    """Sampling temperature when the request sets none (OpenAI's default is 1)."""


class _ForgettingAgents(LRUCache[str, Agent]):
    """An LRU of agents by definition key; every runtime forgets the agent it evicts:
    ``agents = _ForgettingAgents(256, runtimes); agents[key] = agent``."""

    def __init__(self, maxsize: int, runtimes: Sequence[Runtime]) -> None:
        super().__init__(maxsize=maxsize)
        self._runtimes = runtimes

    def popitem(self) -> tuple[str, Agent]:
        """Evict the least recently used agent (mutates; the cache calls it when full)."""
        key, dropped = super().popitem()
        for runtime in self._runtimes:
            runtime.forget_agent(dropped.name)
        return key, dropped


class RequestAgents:
    """Agents made from requests, at most ``KEPT_AGENTS`` (least recently used dropped)."""

    def __init__(self, runtimes: Sequence[Runtime], defaults: AgentDefaults | None = None) -> None:
        """``runtimes`` share one engine; each forgets an agent this cache drops."""
        self.runtimes = tuple(runtimes)
        self.defaults = defaults or AgentDefaults()
        self._agents = _ForgettingAgents(KEPT_AGENTS, self.runtimes)
        self._registered: LRUCache[tuple[str, str], None] = LRUCache(maxsize=KEPT_AGENTS)

    def agent(self, *, instructions: str | None, tools: Sequence[Mapping[str, Any]], tool_choice: str,
              parallel_tool_calls: bool, output: dict[str, Any] | None, salt: str) -> Agent:
        """The agent for this definition (``instructions`` None: the server's default), its prefix
        registered for tenant ``salt``. ``UserError`` (400) for tools or a format it cannot take."""
        system = instructions if instructions is not None else self.defaults.instructions
        key_source = json.dumps([system, list(tools), tool_choice, parallel_tool_calls, output],
                                sort_keys=True, default=str)
        key = hashlib.sha256(key_source.encode()).hexdigest()[:16]
        agent = self._agents.get(key)  # a hit makes it the most recently used
        if agent is None:
            defaults = self.defaults
            agent = Agent(name=f"api-{key}", instructions=system, tools=(*defaults.tools, *(tool(t) for t in tools)),
                          tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, output_type=output,
                          policy=defaults.policy, max_prompt_len=defaults.max_prompt_len,
                          min_response_len=_reserved(defaults),
                          max_model_calls=Agent.max_model_calls if defaults.tools else CLIENT_TOOL_TURNS)
            self._agents[key] = agent  # beyond KEPT_AGENTS, the least recently used is forgotten
        if (key, salt) not in self._registered:  # a membership test leaves the order alone
            self.runtimes[0].register_agent_prefix(agent, salt=salt)
            self._registered[(key, salt)] = None
        return agent


def _reserved(defaults: AgentDefaults) -> int:
    """Tokens kept free for the answer: the server's answer length, within the prompt budget."""
    reserved = min(Agent.min_response_len, defaults.max_new_tokens)
    if defaults.max_prompt_len is not None:
        reserved = min(reserved, defaults.max_prompt_len // 2)
    return reserved


def reserving_answer(agent: Agent, max_tokens: int | None, context_len: int, *, param: str = "max_tokens") -> Agent:
    """``agent`` keeping ``max_tokens`` (what a request asked for, in its field ``param``) free for
    the answer instead of the server's default reserve; ``agent`` itself when the request asked
    for no length. A 400 naming ``param`` when that leaves no room for a prompt."""
    if max_tokens is None:
        return agent
    room = agent.max_prompt(context_len)
    if max_tokens >= room:
        raise ApiError(400, f"{param}={max_tokens} leaves no room for a prompt: this server's prompts may use "
                       f"{room} tokens, answer included; ask for fewer tokens", param=param)
    return dataclasses.replace(agent, min_response_len=max_tokens)
