"""Runtime: owns one engine (and optionally one store); opens and resumes agent sessions.

::

    engine = StatefulEngine()
    runtime = Runtime(engine)
    session = await runtime.open_session(agent)
    result = await runtime.run(session, "hello")
    await runtime.aclose()

Each agent's system prompt + tool schemas is registered with the engine as a shared prefix,
so sessions of agents that share it start from its cached KV.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Sequence

from agentkv.agent import Agent
from agentkv.chat.render import ChatRenderer
from agentkv.conversation import AgentSession
from agentkv.engine.base import Engine
from agentkv.errors import UserError
from agentkv.events import RunEvent
from agentkv.result import RunResult
from agentkv.runner import Runner


class Runtime:
    """One engine, many concurrent sessions; one run at a time per session."""

    def __init__(self, engine: Engine, *, agents: Sequence[Agent] = ()) -> None:
        self.engine = engine
        self.renderer = ChatRenderer(engine.tokenizer)
        self._agents: dict[str, Agent] = {}
        self._sessions: dict[str, AgentSession] = {}
        for agent in agents:
            self.add_agent(agent)

    def add_agent(self, agent: Agent) -> None:
        """Make ``agent`` known (needed to resume its sessions) and register its shared prefix."""
        known = self._agents.get(agent.name)
        if known is not None and known is not agent and known != agent:
            raise UserError(f"another agent named {agent.name!r} is already registered; use a unique name")
        self._agents[agent.name] = agent
        tools = agent.tool_schemas if agent.tool_choice != "none" else []
        from agentkv.chat.messages import Message

        prefix = self.renderer.render([Message.system(agent.instructions)], tools=tools, add_generation_prompt=False)
        self.engine.register_prefix(prefix.token_ids[: prefix.prefix_len])

    async def open_session(self, agent: Agent, *, session_id: str | None = None) -> AgentSession:
        """A new conversation for ``agent``."""
        self.add_agent(agent)
        sid = session_id or uuid.uuid4().hex
        if sid in self._sessions:
            raise UserError(f"session {sid!r} is already open in this runtime")
        kv = await self.engine.open_session()
        session = AgentSession(sid, agent, self.engine, kv, self.renderer)
        self._sessions[sid] = session
        return session

    async def run(self, session: AgentSession, user_input: str) -> RunResult:
        """``Runner.run`` with the session's own agent."""
        return await Runner.run(session.agent, session, user_input)

    def run_stream(self, session: AgentSession, user_input: str) -> AsyncIterator[RunEvent]:
        """``Runner.run_stream`` with the session's own agent."""
        return Runner.run_stream(session.agent, session, user_input)

    async def close_session(self, session: AgentSession) -> None:
        """Release the session's KV."""
        self._sessions.pop(session.id, None)
        await session.close()

    async def aclose(self) -> None:
        """Close every session (the engine stays usable)."""
        for session in list(self._sessions.values()):
            await self.close_session(session)
