"""Lease holder ids (``host:pid:tag``) and whether a holder's process is gone from this host.

A lease whose holder ran on this host in a process that no longer exists can be taken over at
once; anything else keeps its lease until it expires::

    me = holder_id()                       # "box1:4242:9f3a1c"
    holder_is_dead_here("box1:999999:abc") # True on box1 when no process 999999 runs there
"""

from __future__ import annotations

import os
import socket
import uuid
from pathlib import Path


def holder_id(host: str | None = None) -> str:
    """A new holder id for this process: ``holder_id()`` → ``"box1:4242:9f3a1c"``. ``host``: the
    host part instead of this machine's name (a test playing two hosts: ``holder_id("replica-b")``;
    its leases are then another host's, taken over only once they expire)."""
    return f"{host or socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def parse_holder(holder: str) -> tuple[str, int] | None:
    """``(host, pid)`` of a ``host:pid:tag`` holder id, or None if it has another shape.

    ``parse_holder("box1:4242:9f3a1c")`` → ``("box1", 4242)``; ``parse_holder("worker-a")`` → None.
    """
    parts = holder.rsplit(":", 2)
    if len(parts) != 3:
        return None
    host, pid, tag = parts
    if not host or not tag or not (pid.isascii() and pid.isdigit()):
        return None
    number = int(pid)
    return (host, number) if number > 0 else None


def pid_is_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this machine (it may be a reused pid).

    ``pid_is_alive(os.getpid())`` → True. Errs on the side of alive when it cannot tell;
    an exited process not yet reaped by its parent (a zombie) counts as dead.
    """
    if pid <= 0 or os.name != "posix":
        # NOTE: on Windows os.kill(pid, 0) terminates the process; never probe there.
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists but belongs to someone else
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """True for a process that exited but was not reaped yet (Linux ``/proc``; else False)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False
    # The state follows the parenthesised command name, which may itself contain ") ".
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def live_pid_here(holder: str) -> int | None:
    """The pid of ``holder`` when it runs on this host in a process that still exists, else None
    (another host, an id that does not parse, or a process that is gone).

    ``live_pid_here(holder_id())`` → ``os.getpid()``.
    """
    parsed = parse_holder(holder)
    if parsed is None or parsed[0] != socket.gethostname() or not pid_is_alive(parsed[1]):
        return None
    return parsed[1]


def holder_is_dead_here(holder: str) -> bool:
    """True only if ``holder`` ran on this host in a process that no longer exists.

    ``holder_is_dead_here(holder_id())`` → False (this process is alive). A foreign host or an
    unparsable id gives False: those leases are only taken over when they expire.
    """
    # NOTE: "this host" means the same hostname. Containers sharing a hostname but not a pid
    # namespace would see each other's live holders as dead: give each a distinct hostname.
    parsed = parse_holder(holder)
    if parsed is None:
        return False
    host, pid = parsed
    return host == socket.gethostname() and not pid_is_alive(pid)
