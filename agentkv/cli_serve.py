"""``agentkv serve``: build the engine, start uvicorn on the app, print the URL once it listens.

::

    agentkv serve --port 8000 --api-key sk-local
    # → agentkv serving SmolLM2-135M-Instruct at http://127.0.0.1:8000/v1

uvicorn stops cleanly on SIGTERM and SIGINT (the app's shutdown closes every KV session).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import signal
import sys
from dataclasses import dataclass

API_KEY_ENV = "AGENTKV_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    """What ``agentkv serve`` was asked for."""

    host: str
    port: int
    api_key: str | None
    model: str | None
    engine: str | None
    max_sessions: int
    max_running: int
    kv_reuse: bool


def serve(options: ServeOptions) -> None:
    """Run the server until it is told to stop (blocking)."""
    import uvicorn

    from agentkv.engine.factory import open_engine
    from agentkv.server import create_app

    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not _is_loopback(options.host):
        print(f"warning: serving on {options.host} without an API key: anyone who can reach it can use it "
              f"(pass --api-key or set {API_KEY_ENV})", file=sys.stderr)
    engine = open_engine(options.model, backend=options.engine)  # type: ignore[arg-type]
    model_id = _model_id(engine)
    app = create_app(engine, api_key=api_key, model_id=model_id, max_sessions=options.max_sessions,
                     max_running=options.max_running, reuse_kv=options.kv_reuse)
    server = uvicorn.Server(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           timeout_graceful_shutdown=10))

    # NOTE: uvicorn shuts down gracefully on SIGTERM, then raises the signal again under the
    # handler it found: make that one a clean exit (0), not the default kill (-15)
    signal.signal(signal.SIGTERM, _exit_cleanly)

    async def run() -> None:
        task = asyncio.create_task(server.serve())
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            host = f"[{options.host}]" if ":" in options.host else options.host
            print(f"agentkv serving {model_id} at http://{host}:{options.port}/v1", flush=True)
        await task

    asyncio.run(run())


def _exit_cleanly(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _model_id(engine: object) -> str:
    files = getattr(engine, "files", None)
    gguf = getattr(files, "gguf_path", None)
    if gguf is not None:
        return str(gguf.stem).split(".")[0]
    ir_dir = getattr(files, "ir_dir", None)
    return ir_dir.name if ir_dir is not None else "agentkv"


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
