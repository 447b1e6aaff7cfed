"""A uvicorn server whose first SIGTERM drains before it stops, so a proxy moves traffic away first.

::

    server = DrainingServer(uvicorn.Config(app, port=8000), readiness=app.state.readiness, drain_s=5)
    await server.serve()     # SIGTERM: /ready answers 503 at once, requests still served for 5 s, then
                             # uvicorn's own graceful shutdown; a second SIGTERM (or SIGINT) starts that at once
"""

from __future__ import annotations

import signal
import sys
import time
from types import FrameType

import uvicorn

from agentkv.server.readiness import Readiness


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM drains (``Readiness.drain``) for ``drain_s`` seconds
    before the graceful shutdown uvicorn does by itself (``drain_s=0``: none, uvicorn's behaviour)."""

    def __init__(self, config: uvicorn.Config, *, readiness: Readiness, drain_s: float) -> None:
        super().__init__(config)
        self.readiness = readiness
        self.drain_s = drain_s
        self.drain_until: float | None = None
        """When the drain ends (monotonic seconds); None until a SIGTERM started one."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and self.drain_s > 0 and self.drain_until is None and not self.should_exit:
            self.readiness.drain(f"SIGTERM: stopping in {self.drain_s:g} s")
            self.drain_until = time.monotonic() + self.drain_s
            print(f"agentkv draining: /ready answers 503, stopping in {self.drain_s:g} s", file=sys.stderr, flush=True)
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and time.monotonic() >= self.drain_until:
            self.should_exit = True
        return await super().on_tick(counter)
