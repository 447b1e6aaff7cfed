"""Readiness: whether this server should be sent new conversations (``GET /ready``) — not before
it has started, nor while it drains for shutdown, nor while its store cannot be reached.

``/health`` says the process lives; ``/ready`` says a proxy may route to it::

    readiness = Readiness(store)
    readiness.start()                   # the app's startup: the engine is compiled by then
    ready, reason = await readiness.check()
    readiness.drain("shutting down")    # the shutdown path: /ready answers 503 from now on
"""

from __future__ import annotations

import anyio

from agentkv.errors import ConversationNotFound
from agentkv.memory import Store

STORE_PROBE_TIMEOUT_S = 2.0
"""Seconds the store has to answer a readiness probe before the server counts as not ready."""
_PROBE_ID = "agentkv-readiness-probe"


class Readiness:
    """Started, not draining, store reachable. See the module docstring for a call."""

    def __init__(self, store: Store | None) -> None:
        """``store``: probed on every check (None: nothing to reach)."""
        self.store = store
        self.started = False
        self.draining: str | None = None
        """Why the server drains (None: it does not); set by ``drain``."""

    def start(self) -> None:
        """The server has started: the engine is compiled and requests can run."""
        self.started = True

    def drain(self, reason: str = "the server is shutting down") -> None:
        """Answer 503 from now on: the server finishes what it runs and takes nothing new::

            app.state.readiness.drain("draining for a restart")
        """
        self.draining = reason

    async def check(self) -> tuple[bool, str]:
        """Whether the server is ready, and why not (``"ready"`` when it is)."""
        if self.draining is not None:
            return False, f"draining: {self.draining}"
        if not self.started:
            return False, "starting: the server has not finished starting"
        if self.store is not None:
            problem = await self._store_problem()
            if problem is not None:
                return False, f"the store cannot be reached ({problem})"
        return True, "ready"

    async def _store_problem(self) -> str | None:
        """None when the store answers a read (a missing session is an answer), else what went wrong."""
        assert self.store is not None
        try:
            with anyio.fail_after(STORE_PROBE_TIMEOUT_S):
                await self.store.get_conversation(_PROBE_ID)
        except ConversationNotFound:
            return None
        except TimeoutError:
            return f"no answer in {STORE_PROBE_TIMEOUT_S:g} s"
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return None
