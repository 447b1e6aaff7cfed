"""ScriptedSession: the engine's own ``SlotSession`` over fake KV slots, replying from a script.

Alignment (longest common prefix; a fully covered prompt still feeds its last token), trim,
fork, offload, snapshot / restore and RoPE span drops are the real code of
``engine/session/session.py`` running on ``FakeSlot`` s; only the token chooser is scripted::

    session = await engine.open_session()
    await session.prefill(ids)
    assert session.tokens == tuple(ids)
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from agentkv.engine.base import GenerationConfig, TokenConstraint
from agentkv.engine.generation import GenerationResult, TokenDelta
from agentkv.engine.session.session import SlotSession
from agentkv.testing.decode import ScriptedDecode


class ScriptedSession(SlotSession):
    """A ``SlotSession`` whose generations follow the ``ScriptedEngine``'s script."""

    def __init__(self, backend: Any, session_id: str | None = None, **state: Any) -> None:
        super().__init__(backend, session_id, **state)
        self.drops: list[tuple[int, int]] = []
        """Every ``drop(start, end)`` applied, in order (for tests)."""

    async def _generate_events(
        self, prompt: list[int], config: GenerationConfig, constraint: TokenConstraint | None
    ) -> AsyncIterator[TokenDelta | GenerationResult]:
        async with self._lock:
            self._ensure_open()
            backend: Any = self._backend  # a ScriptedBackend (testing/scripted.py imports this module)
            call = backend.script.begin_call(self.id, prompt, config, constraint is not None)
            reply_ids = backend.tokenizer.encode(await backend.script.reply_for(call))
            async with self._lease() as slot:
                started = time.perf_counter()
                align = await self._align(slot, prompt)
                loop = ScriptedDecode(backend, self._log, slot, self._run, prompt, config, constraint, align,
                                      started, reply_ids=reply_ids)
                async for event in loop.run():
                    if isinstance(event, GenerationResult):
                        call.result = event
                    yield event

    async def drop(self, start: int, end: int) -> None:
        """``SlotSession.drop``, recorded in ``drops`` once applied."""
        await super().drop(start, end)
        if start != end:
            self.drops.append((start, end))
