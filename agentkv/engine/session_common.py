"""Plumbing every KVSession / Engine implementation shares: identity, read-only views of the
token log, the stream/generate entry points, the checks made before any state changes, and
the engine's bookkeeping of its open sessions.

Subclasses (``StatefulSession``, the scripted ``ScriptedSession``) set ``_id``, ``_tokens``,
``_shifted``, ``_closed`` and ``_engine`` and implement ``_generate_events``::

    class MySession(SessionCommon):
        async def _generate_events(self, prompt, config, constraint): ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from agentkv.engine.base import (
    GenerationConfig,
    GenerationResult,
    GenerationStream,
    TokenConstraint,
    TokenDelta,
    validate_prompt,
)
from agentkv.errors import SessionClosed, UserError


class SessionCommon:
    """Shared by the KV session implementations (no OpenVINO here)."""

    _id: str
    _tokens: list[int]
    _shifted: bool
    _kv_exact: bool = True
    _closed: bool
    _engine: Any

    @property
    def id(self) -> str:
        return self._id

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    @property
    def shifted(self) -> bool:
        return self._shifted

    @property
    def kv_exact(self) -> bool:
        """False once part of the KV came back from a lossy restore (a u8 cache through the
        state API, or a snapshot stored in a rounding precision): close to, not equal to, what
        the model computed. A trim to 0 makes it exact again."""
        return self._kv_exact

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self._id[:8]}, tokens={len(self.tokens)})"

    def stream(
        self,
        prompt_tokens: Sequence[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None = None,
    ) -> GenerationStream:
        """See ``KVSession.stream``: checks happen now, the work when the stream is iterated."""
        prompt = [int(t) for t in prompt_tokens]
        self._check_prompt(prompt, config)
        return GenerationStream(self._generate_events(prompt, config, constraint))

    async def generate(
        self,
        prompt_tokens: Sequence[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None = None,
    ) -> GenerationResult:
        """``stream(...)`` run to the end."""
        return await self.stream(prompt_tokens, config, constraint).collect()

    def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        raise TypeError(f"{type(self).__name__} must define _generate_events")

    def _check_prompt(self, prompt: list[int], config: GenerationConfig) -> None:
        self._ensure_open()
        validate_prompt(prompt, config, self._engine.max_context_len)

    def _check_span(self, start: int, end: int) -> None:
        """``drop(start, end)``'s argument check (no state change)."""
        self._ensure_open()
        if not 0 <= start <= end <= len(self.tokens):
            raise UserError(
                f"drop({start}, {end}) is outside the session's {len(self.tokens)} tokens; "
                "pass 0 <= start <= end <= len(session.tokens)"
            )

    def _ensure_open(self) -> None:
        if self._closed:
            raise SessionClosed(f"session {self._id} is closed; open a new one with engine.open_session()")


class EngineCommon:
    """The open-session bookkeeping of an engine: ``session_class(engine)`` makes a session,
    ``close()`` on it calls ``forget``; ``aclose`` closes whatever is still open."""

    session_class: type[Any]
    _sessions: set[Any]
    _max_context_len: int

    @property
    def max_context_len(self) -> int:
        return self._max_context_len

    async def open_session(self) -> Any:
        """A new empty session."""
        return self.new_session()

    def new_session(self, **state: Any) -> Any:
        """Synchronous constructor used by ``open_session`` and ``fork`` (``state``: what a
        forked session starts with, passed to ``session_class``)."""
        session = self.session_class(self, **state)
        self._sessions.add(session)
        return session

    def forget(self, session: Any) -> None:
        """Called by ``session.close()``."""
        self._sessions.discard(session)

    async def aclose(self) -> None:
        """Close every open session."""
        for session in list(self._sessions):
            await session.close()
