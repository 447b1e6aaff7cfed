"""The KVSession entry points a session class inherits: identity, ``stream`` / ``generate``
over its ``_generate_events``, and the checks made before any state changes.

A subclass (``SlotSession``) sets ``_id``, ``_closed`` and ``_engine``, and provides ``tokens``
and ``_generate_events``::

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
    _closed: bool
    _engine: Any
    tokens: tuple[int, ...]  # the subclass's token log (a property)

    @property
    def id(self) -> str:
        return self._id

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
