"""``agentkv serve``: build the engine, start uvicorn on the app, print the URL once it listens.

::

    agentkv serve --port 8000 --api-key sk-local --db sqlite:///srv/agentkv.db --system "Be brief."
    # → agentkv serving SmolLM2-135M-Instruct at http://127.0.0.1:8000/v1
    agentkv serve --db postgresql+psycopg2://u:p@db/agentkv --snapshots s3://bucket/kv   # KV snapshots on S3

With ``--drain-seconds N``, SIGTERM first drains: ``/ready`` answers 503 at once while requests are
still served for N seconds, so a proxy's health check takes the replica out before it stops (a
second SIGTERM, or SIGINT, starts the shutdown at once). Then uvicorn stops cleanly: streams
still going end with a last event (a chunk with a finish reason and ``[DONE]``,
``response.failed``) within ``SHUTDOWN_GRACE_S``, runs still going
are cancelled (each snapshots its conversation's KV as it ends), every open conversation whose KV
no stored snapshot holds yet is snapshotted, and every KV session is closed; stored responses
resume after a restart, or on another replica. One access log line per request goes to stderr.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

from agentkv.agent import Agent
from agentkv.cli.agent import CLI_TOOLS, AgentOptions, apply_options, check_window
from agentkv.cli.config import KVTierOptions
from agentkv.memory.leases import CROSS_HOST_TAKEOVER_S, DEFAULT_LEASE_WAIT_S
from agentkv.server.request_agents import AgentDefaults

if TYPE_CHECKING:
    from agentkv.engine.factory import Backend

API_KEY_ENV = "AGENTKV_API_KEY"


@dataclass(frozen=True)
class ServeOptions:
    """What ``agentkv serve`` was asked for."""

    host: str
    port: int
    api_key: str | None
    db: str | None
    model: str | None
    engine: Backend | None
    max_sessions: int
    max_running: int
    kv_reuse: bool
    agent: AgentOptions
    snapshots: str | None = None
    """Where KV snapshots go (``--snapshots``): ``s3://bucket/prefix``, ``file:///dir`` or a
    directory; None: ``$AGENTKV_SNAPSHOT_URL``, else beside the database."""
    exact: bool = False
    """``--exact``: exact numerics (f32 KV, no dynamic quantisation): greedy answers that are the
    same on every replica and after every restore, at some speed."""
    lease_wait_s: float = DEFAULT_LEASE_WAIT_S
    """``--lease-wait``: seconds a request waits for a conversation another replica runs (then 409)."""
    kv_tiers: KVTierOptions = KVTierOptions()
    """``--kv-host-mb``, ``--kv-disk``, ``--kv-disk-gb``: the KV block tiers in front of the snapshots."""
    drain_s: float = 0.0
    """``--drain-seconds``: after SIGTERM, seconds ``/ready`` answers 503 while requests are still
    served (so a proxy's health check moves traffic away) before the server shuts down."""


def agent_defaults(options: AgentOptions, context_len: int | None = None) -> AgentDefaults:
    """The server's agent defaults from the CLI's agent options (``CLIUsageError`` for a
    combination no request could run under, e.g. a window over the model's context)."""
    options.check()
    probe = apply_options(Agent(name="serve", instructions=None), options)  # validates like `agentkv chat`
    check_window(probe, context_len)
    fallback = AgentDefaults()
    return AgentDefaults(
        instructions=options.system,
        tools=CLI_TOOLS if options.tools else (),
        policy=probe.policy,
        max_prompt_len=options.max_prompt_len,
        max_new_tokens=options.max_new_tokens or fallback.max_new_tokens,
        temperature=fallback.temperature if options.temperature is None else options.temperature,
    )


def serve(options: ServeOptions) -> None:
    """Run the server until it is told to stop (blocking)."""
    import uvicorn

    from agentkv.cli.config import model_choice, open_store
    from agentkv.server.draining import DrainingServer
    from agentkv.engine.factory import open_engine
    from agentkv.server import create_app

    agent_defaults(options.agent)  # a bad option fails before the model loads
    if 0 < options.lease_wait_s < CROSS_HOST_TAKEOVER_S:
        print(f"warning: --lease-wait {options.lease_wait_s:g} is shorter than the {CROSS_HOST_TAKEOVER_S:g} s "
              f"another host's crashed replica keeps its conversations' leases: a request for one of them gets "
              f"409 until the lease expires (use --lease-wait {CROSS_HOST_TAKEOVER_S:g} or more)", file=sys.stderr)
    api_key = options.api_key or os.environ.get(API_KEY_ENV) or None
    if api_key is None and not _is_loopback(options.host):
        print(f"warning: serving on {options.host} without an API key: anyone who can reach it can use it "
              f"(pass --api-key or set {API_KEY_ENV})", file=sys.stderr)
    store = open_store(options.db, options.snapshots, options.kv_tiers)
    store.files.check()  # a bad URL, unreachable endpoint or missing bucket fails before the model loads
    store.blocks.check()
    engine = open_engine(model_choice(options.model), backend=options.engine, exact=options.exact)
    model_id = _model_id(engine)
    app = create_app(engine, store=store, api_key=api_key, model_id=model_id,
                     max_sessions=options.max_sessions, max_running=options.max_running, reuse_kv=options.kv_reuse,
                     defaults=agent_defaults(options.agent, engine.max_context_len), lease_wait_s=options.lease_wait_s)
    server = DrainingServer(uvicorn.Config(app, host=options.host, port=options.port, log_level="warning",
                                           timeout_graceful_shutdown=10),
                            readiness=app.state.readiness, drain_s=options.drain_s)
    _log_access_to_stderr()

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


def _log_access_to_stderr() -> None:
    """The server's access log (one line per request) on stderr, uvicorn's own access log being off."""
    from agentkv.server.access_log import ACCESS_LOGGER

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
    ACCESS_LOGGER.addHandler(handler)
    ACCESS_LOGGER.setLevel(logging.INFO)


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

