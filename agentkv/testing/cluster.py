"""A local scale-out cluster for tests and benchmarks: N ``agentkv serve`` replicas on loopback
ports sharing one database and one snapshot store, behind HAProxy configured by ``deploy/haproxy.cfg``.

::

    from agentkv.testing.cluster import LocalCluster

    with LocalCluster(3, db="postgresql+psycopg2://u:p@127.0.0.1/agentkv",
                      snapshots="s3://bucket/prefix", serve_args=["--exact"]) as cluster:
        client = openai.OpenAI(base_url=cluster.proxy_url + "/v1", api_key=cluster.api_key)
        answer = client.responses.with_raw_response.create(model="any", input="Hi")
        i = cluster.replica_of(answer.headers["X-Served-By"])    # which replica answered
        cluster.kill(i)                                           # SIGKILL: a crash
        cluster.start(i)                                          # back on the same port

Replicas and HAProxy write their output to log files in ``cluster.log_dir`` (``replica<N>.log``,
``haproxy.log``). It runs processes only: nothing here imports OpenVINO. The S3 credentials and
endpoint come from the ``AWS_*`` environment variables, as for ``agentkv serve``.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from agentkv.errors import UserError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "haproxy.cfg"
"""The HAProxy config of the repository (the one users run): its replica blocks are rendered for N."""
BACKEND = "agentkv_replicas"
"""The backend section of ``deploy/haproxy.cfg`` whose servers are the replicas."""
_DEFAULT = re.compile(r"(\$\{AGENTKV_REPLICA_1)-[^}]*\}")
_BLOCK = re.compile(r"^[ \t]*# >>> replicas.*?\n(?P<lines>.*?)^[ \t]*# <<< replicas", re.M | re.S)


class ClusterError(UserError):
    """A replica or the proxy did not start (the message names the log to read), or HAProxy is missing."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now::

        port = free_port()
    """
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def render_haproxy_config(template: str, replicas: int) -> str:
    """``template`` (``deploy/haproxy.cfg``'s text) with each of its replica blocks made of
    ``replicas`` server lines, each a copy of the block's first line with its number changed::

        render_haproxy_config(DEFAULT_CONFIG.read_text(encoding="utf-8"), 5)  # replica1..5, ${AGENTKV_REPLICA_1..5}
    """
    def render(block: re.Match[str]) -> str:
        servers = [line for line in block.group("lines").splitlines() if line.strip().startswith("server ")]
        if not servers or "replica1" not in servers[0] or "AGENTKV_REPLICA_1" not in servers[0]:
            raise ClusterError("a '# >>> replicas' block of the HAProxy config does not start with "
                               "'server replica1 \"${AGENTKV_REPLICA_1…}\"': restore it from deploy/haproxy.cfg")
        first = _DEFAULT.sub(r"\1}", servers[0])  # no default address: each replica's comes from the environment
        lines = [re.sub(r"\breplica1\b", f"replica{k}", first).replace("AGENTKV_REPLICA_1", f"AGENTKV_REPLICA_{k}")
                 for k in range(1, replicas + 1)]
        whole = block.group(0)
        at = block.start("lines") - block.start()
        return whole[:at] + "\n".join(lines) + "\n" + whole[at + len(block.group("lines")):]

    rendered, blocks = _BLOCK.subn(render, template)
    if blocks == 0:
        raise ClusterError("the HAProxy config has no '# >>> replicas' … '# <<< replicas' block: "
                           "restore it from deploy/haproxy.cfg")
    return rendered


def haproxy_binary() -> str:
    """The path of the ``haproxy`` binary (``ClusterError`` when it is not installed)::

        haproxy_binary()    # "/usr/sbin/haproxy"
    """
    found = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if found is None:
        raise ClusterError("haproxy is not installed: run 'bash scripts/start_haproxy.sh' (apt-get install -y haproxy)")
    return found


@dataclass
class Replica:
    """One ``agentkv serve`` process of the cluster (None while stopped)."""

    name: str
    """Its server name in HAProxy (``replica1``…), which answers carry as ``X-Served-By``."""
    port: int
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    startup_s: list[float] = field(default_factory=list)
    """Seconds from launch to ``/ready`` answering 200, one per start."""


class LocalCluster:
    """Replicas behind HAProxy on loopback. See the module docstring for a call."""

    def __init__(self, replicas: int = 3, *, db: str, snapshots: str, serve_args: Sequence[str] = (),
                 api_key: str = "sk-agentkv-cluster", env: Mapping[str, str] | None = None,
                 log_dir: Path | None = None, config: Path = DEFAULT_CONFIG, startup_timeout_s: float = 300) -> None:
        """Start ``replicas`` servers (``agentkv serve --db db --snapshots snapshots *serve_args``,
        ``AGENTKV_API_KEY=api_key``) at once, and HAProxy in front; return when every replica is
        ready and HAProxy sees each one up. ``env``: extra environment variables for the replicas;
        ``log_dir``: where the logs go (default: a temporary directory removed by ``close``)."""
        if replicas < 1:
            raise ClusterError(f"a cluster needs at least one replica, not {replicas}")
        self.api_key = api_key
        self.db = db
        self.snapshots = snapshots
        self.serve_args = tuple(serve_args)
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self._own_dir = log_dir is None
        self.log_dir = Path(tempfile.mkdtemp(prefix="agentkv-cluster-")) if log_dir is None else log_dir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.replicas = [Replica(f"replica{k}", free_port()) for k in range(1, replicas + 1)]
        self.proxy_port = free_port()
        self.stats_port = free_port()
        self._haproxy: subprocess.Popen[bytes] | None = None
        self._haproxy_log: IO[bytes] | None = None
        try:
            binary = haproxy_binary()
            launched = [self._launch(i) for i in range(replicas)]
            self._start_haproxy(binary, render_haproxy_config(config.read_text(encoding="utf-8"), replicas))
            for i, began in enumerate(launched):
                self._wait_ready(i, began)
            for i in range(replicas):
                self.wait_proxy_state(i, up=True)
        except BaseException:
            self.close()
            raise

    @property
    def proxy_url(self) -> str:
        """The proxy's base URL (``http://127.0.0.1:<port>``; the OpenAI API is under ``/v1``)."""
        return f"http://127.0.0.1:{self.proxy_port}"

    def replica_url(self, i: int) -> str:
        """Replica ``i``'s own base URL (0-based), bypassing the proxy."""
        return f"http://127.0.0.1:{self.replicas[i].port}"

    def replica_of(self, served_by: str) -> int:
        """The index of the replica an answer's ``X-Served-By`` header names::

            cluster.replica_of("replica2")   # 1
        """
        names = [r.name for r in self.replicas]
        if served_by not in names:
            raise ClusterError(f"no replica {served_by!r} in this cluster ({', '.join(names)})")
        return names.index(served_by)

    def startup_seconds(self, i: int) -> list[float]:
        """Seconds each start of replica ``i`` took, from launch to ``/ready`` 200."""
        return list(self.replicas[i].startup_s)

    def kill(self, i: int) -> None:
        """SIGKILL replica ``i`` (a crash: nothing is snapshotted on the way out) and reap it."""
        process = self._process(i)
        process.kill()
        process.wait()
        self._closed(i)

    def stop(self, i: int, timeout_s: float = 120) -> int:
        """SIGTERM replica ``i`` and wait for it to exit (with ``--drain-seconds`` it drains
        first); its exit code. ``subprocess.TimeoutExpired`` if it outlives ``timeout_s``."""
        process = self._process(i)
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=timeout_s)
        self._closed(i)
        return code

    def start(self, i: int) -> None:
        """Start replica ``i`` again on its port (after ``kill`` or ``stop``); return when it is
        ready and HAProxy sees it up."""
        if self.replicas[i].process is not None:
            raise ClusterError(f"{self.replicas[i].name} is running: kill or stop it first")
        self._wait_ready(i, self._launch(i))
        self.wait_proxy_state(i, up=True)

    def proxy_state(self, i: int) -> str:
        """HAProxy's status of replica ``i``: ``UP``, ``DOWN``, ``UP 1/2`` (going down), ``NOLB``…"""
        csv = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        header = csv.splitlines()[0].lstrip("# ").split(",")
        name_at, server_at, status_at = header.index("pxname"), header.index("svname"), header.index("status")
        for row in csv.splitlines()[1:]:
            cells = row.split(",")
            if len(cells) > status_at and cells[name_at] == BACKEND and cells[server_at] == self.replicas[i].name:
                return cells[status_at]
        raise ClusterError(f"HAProxy does not list {self.replicas[i].name}: read {self.log_dir / 'haproxy.log'}")

    def wait_proxy_state(self, i: int, *, up: bool, timeout_s: float = 30) -> None:
        """Wait until HAProxy has marked replica ``i`` up (``up=True``, status ``UP``) or out of
        rotation (``DOWN``, ``MAINT``, ``NOLB``); ``ClusterError`` after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        state = ""
        while time.monotonic() < deadline:
            state = self.proxy_state(i)
            if (state == "UP") if up else state.split()[0] in ("DOWN", "MAINT", "NOLB"):
                return
            time.sleep(0.1)
        raise ClusterError(f"HAProxy still says {state!r} of {self.replicas[i].name} after {timeout_s:.0f} s "
                           f"(wanted {'UP' if up else 'DOWN'}): read {self.log_dir}")

    def close(self) -> None:
        """SIGTERM every replica still running (SIGKILL after 60 s) and the proxy; remove the
        log directory if the cluster made it. Harmless twice."""
        for replica in self.replicas:
            if replica.process is not None:
                replica.process.send_signal(signal.SIGTERM)
        for i, replica in enumerate(self.replicas):
            if replica.process is not None:
                try:
                    replica.process.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    replica.process.kill()
                    replica.process.wait()
                self._closed(i)
        if self._haproxy is not None:
            self._haproxy.terminate()
            try:
                self._haproxy.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._haproxy.kill()
                self._haproxy.wait()
            self._haproxy = None
        if self._haproxy_log is not None:
            self._haproxy_log.close()
            self._haproxy_log = None
        if self._own_dir:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _launch(self, i: int) -> float:
        """Start replica ``i``'s process (output appended to its log); the launch time."""
        replica = self.replicas[i]
        replica.log = open(self.log_dir / f"{replica.name}.log", "ab")
        command = [sys.executable, "-m", "agentkv.cli.app", "serve", "--host", "127.0.0.1",
                   "--port", str(replica.port), "--db", self.db, "--snapshots", self.snapshots, *self.serve_args]
        env = {**os.environ, **self.env, "AGENTKV_API_KEY": self.api_key}
        # NOTE: output to a file, never an unread PIPE: a full pipe would block the server
        replica.process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=replica.log,
                                           stderr=subprocess.STDOUT, env=env)
        return time.monotonic()

    def _wait_ready(self, i: int, began: float) -> None:
        """Poll replica ``i``'s ``/ready`` until 200; ``ClusterError`` if it exits or times out."""
        replica, process = self.replicas[i], self._process(i)
        deadline = began + self.startup_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise ClusterError(f"{replica.name} exited with code {process.returncode} while starting: "
                                   f"{self._tail(replica.name)}")
            try:
                if httpx.get(self.replica_url(i) + "/ready", timeout=2).status_code == 200:
                    replica.startup_s.append(time.monotonic() - began)
                    return
            except httpx.TransportError:
                pass  # not listening yet
            time.sleep(0.2)
        raise ClusterError(f"{replica.name} was not ready after {self.startup_timeout_s:.0f} s: "
                           f"{self._tail(replica.name)}")

    def _start_haproxy(self, binary: str, config: str) -> None:
        path = self.log_dir / "haproxy.cfg"
        path.write_text(config, encoding="utf-8")
        env = {**os.environ, "AGENTKV_PROXY_BIND": f"127.0.0.1:{self.proxy_port}",
               "AGENTKV_PROXY_STATS_BIND": f"127.0.0.1:{self.stats_port}",
               "AGENTKV_PROXY_SOCKET": str(self.log_dir / "haproxy.sock"),
               **{f"AGENTKV_REPLICA_{k}": f"127.0.0.1:{r.port}" for k, r in enumerate(self.replicas, start=1)}}
        self._haproxy_log = open(self.log_dir / "haproxy.log", "ab")
        self._haproxy = subprocess.Popen([binary, "-db", "-f", str(path)], stdin=subprocess.DEVNULL,
                                         stdout=self._haproxy_log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self._haproxy.poll() is not None:
                raise ClusterError(f"haproxy exited with code {self._haproxy.returncode}: {self._tail('haproxy')}")
            try:
                httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=2)
                return
            except httpx.TransportError:
                time.sleep(0.1)
        raise ClusterError(f"haproxy did not listen within 15 s: {self._tail('haproxy')}")

    def _process(self, i: int) -> subprocess.Popen[bytes]:
        process = self.replicas[i].process
        if process is None:
            raise ClusterError(f"{self.replicas[i].name} is not running: start it first")
        return process

    def _closed(self, i: int) -> None:
        replica = self.replicas[i]
        replica.process = None
        if replica.log is not None:
            replica.log.close()
            replica.log = None

    def _tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return f"last lines of {path}:\n" + "\n".join(text.splitlines()[-lines:])
