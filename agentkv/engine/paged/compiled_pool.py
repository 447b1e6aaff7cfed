"""Compiled paged graphs shared by this process's models on the same model and settings, and kept for the next.

OpenVINO's compiled-blob cache cannot hold a PagedAttention graph (its import loses the ops'
head sizes and the plugin compiles again: ``graphs.py``), so a paged model compiles its graphs,
~3.6 s each for the default model on 2 cores (in parallel: its three in 5–6 s). Two ways around it:

- **Live models share**: a ``PagedModel`` on a key another live model uses runs on the same
  compiled models (each makes its own infer requests over its own KV blocks) and compiles nothing;
  a model opening while the first still compiles waits for that compile. The set is reference
  counted by leases and leaves when its last user releases its lease (an engine closed, or
  collected)::

      lease = COMPILED.share(key, lambda: compile_now(...))  # a live set, an idle one, or compiled
      lease.decode, lease.whole                               # the decode graph; the whole set's future
      lease.release()                                         # twice is harmless

- **Idle sets wait for the next model**: the set its last user released is kept while
  ``AGENTKV_KEEP_COMPILED`` says how many idle graphs to keep (each holds its compiled weights,
  ~80–130 MB for the default model): a test suite, a notebook or a script that reopens engines::

      held = COMPILED.take(key)            # None, or the graphs an engine released
      COMPILED.give_back(key, held)        # kept while the limit allows, the oldest dropped first

  Only whole sets are kept: ``AGENTKV_KEEP_COMPILED`` below an engine's graph count (3 for the
  default model) keeps none of it.

NOTE: the CPU plugin runs one infer at a time on a stream's graph (a lock per graph, as for one
engine's own requests), so two engines stepping at the same moment on a shared set take turns
(what a test suite's engines, idle while another steps, never notice; not measured for engines
that both decode at once in one process).
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from agentkv.errors import UserError

if TYPE_CHECKING:
    import openvino as ov

    from agentkv.engine.openvino.models import ModelFiles

KEEP_ENV = "AGENTKV_KEEP_COMPILED"
"""Idle compiled graphs this process keeps (default 0: an engine's graphs go with it)."""


@dataclass(frozen=True)
class GraphKey:
    """What a compiled paged graph depends on: the model files as they are on disk now (the paths
    OpenVINO reads, and what they lead to: a hub cache's symlinks to shared blobs included), the
    device, the plugin config and the KV blocks' element type, and how many graphs are asked."""

    files: tuple[tuple[str, tuple[int, int, int, int]], ...]
    device: str
    config: tuple[tuple[str, str], ...]
    kv_cache_precision: str
    graphs: int

    @classmethod
    def of(cls, files: ModelFiles, device: str, config: dict[str, str], kv_cache_precision: str, *,
           graphs: int) -> GraphKey:
        """The key for ``files`` compiled on ``device`` with ``config``::

            GraphKey.of(files, "CPU", {}, "f16", graphs=2)
        """
        xml = files.model_xml.absolute()
        return cls(tuple((str(path), _identity(path)) for path in (xml, xml.with_suffix(".bin"))), device.upper(),
                   tuple(sorted((k, str(v)) for k, v in config.items())), kv_cache_precision, graphs)


def _identity(path: Path) -> tuple[int, int, int, int]:
    """Device, inode, size and modification time of the file ``path`` leads to; zeros when none."""
    try:
        stat = path.stat()  # NOTE: follows symlinks: the blob the model's file points to
    except OSError:
        return (0, 0, 0, 0)
    return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)


@dataclass(frozen=True)
class HeldGraphs:
    """The compiled graphs of one ``PagedModel`` and what it read from the model to build them."""

    compiled: tuple[ov.CompiledModel, ...]
    """The decode graph, then the chunk graph and the small-step graph if there are (``graphs.GRAPH_NAMES``)."""
    heads: int
    head_dim: int
    num_layers: int


OpenedGraphs = tuple[HeldGraphs, Future[HeldGraphs]]
"""What opening a set gives: the decode graph (compiled), and the whole set (maybe still compiling)."""


@dataclass(eq=False)
class _LiveSet:
    """A set live models run on: how many leases hold it, and its graphs once opened."""

    users: int
    opened: Future[OpenedGraphs] = field(default_factory=Future)
    """Set by the model that opened the set (an idle set taken, or compiled), failed when it failed."""


@dataclass(eq=False)
class GraphLease:
    """One model's use of a live set (``CompiledPool.share``): run steps on ``decode`` and on
    ``whole`` once done; ``release()`` when done with them (twice is harmless;
    ``release(collecting=True)`` in a ``weakref.finalize``)."""

    pool: CompiledPool
    key: GraphKey
    decode: HeldGraphs
    """The decode graph alone while the others compile, or the whole set."""
    whole: Future[HeldGraphs]
    """Every graph that compiled, the decode graph first (``graphs.CompilingGraphs.whole``)."""
    _live: _LiveSet
    _once: threading.Lock = field(default_factory=threading.Lock)

    def release(self, *, collecting: bool = False) -> None:
        """Stop using the set: the last lease's release hands it to the idle sets once whole
        (``AGENTKV_KEEP_COMPILED``), else its graphs go once nothing else holds them.
        ``collecting=True`` (a ``weakref.finalize``): never waits for the pool's lock, counted at
        the pool's next use when it is busy::

            lease.release()
        """
        if self._once.acquire(blocking=False):
            self.pool._leave(self.key, self._live, wait=not collecting)  # noqa: SLF001 - the pool's half


class CompiledPool:
    """Live sets by key with their users, and idle ``HeldGraphs`` by key, the most recently
    given back last. Thread-safe, and ``give_back`` and ``GraphLease.release(collecting=True)``
    may run in a garbage collection (a ``weakref.finalize``): they never wait for the lock."""

    def __init__(self) -> None:
        self._live: dict[GraphKey, _LiveSet] = {}
        self._idle: OrderedDict[GraphKey, list[HeldGraphs]] = OrderedDict()
        self._lock = threading.Lock()
        self._returned: queue.SimpleQueue[tuple[GraphKey, HeldGraphs]] = queue.SimpleQueue()
        """Given back, not filed yet. NOTE: a collection may run a finalizer in a thread that holds
        ``_lock``, so ``give_back`` never takes it (``SimpleQueue.put`` is safe there)."""
        self._left: queue.SimpleQueue[tuple[GraphKey, _LiveSet]] = queue.SimpleQueue()
        """Leases released and not counted yet (as ``_returned``: filed under ``_lock``)."""

    def share(self, key: GraphKey, open_graphs: Callable[[], OpenedGraphs]) -> GraphLease:
        """A lease on the live set for ``key``: the set another model runs on (waiting for its
        decode graph if it is still compiling), else an idle set taken, else ``open_graphs()``
        (run without the lock; what it raises is raised here and to the models waiting for it)::

            lease = COMPILED.share(key, lambda: (held, finished(held)))
        """
        with self._lock:
            self._file_queued()
            live = self._live.get(key)
            opener, idle = live is None, None
            if live is None:
                live = self._live[key] = _LiveSet(users=1)
                idle = self._take_idle(key)
            else:
                live.users += 1
        if opener:
            try:
                live.opened.set_result(open_graphs() if idle is None else (idle, finished(idle)))
            except BaseException as error:
                with self._lock:
                    if self._live.get(key) is live:
                        del self._live[key]
                live.opened.set_exception(error)
                raise
        decode, whole = live.opened.result()
        return GraphLease(self, key, decode, whole, live)

    def users(self, key: GraphKey) -> int:
        """Leases on the live set for ``key`` now (0: none live): ``COMPILED.users(key)``."""
        with self._lock:
            self._file_queued()
            live = self._live.get(key)
            return 0 if live is None else live.users

    def take(self, key: GraphKey) -> HeldGraphs | None:
        """Idle graphs for ``key`` (now the caller's), or None."""
        with self._lock:
            self._file_queued()
            return self._take_idle(key)

    def give_back(self, key: GraphKey, graphs: HeldGraphs) -> None:
        """Hand ``graphs`` on: kept for the next ``take(key)`` while ``AGENTKV_KEEP_COMPILED``
        allows, the oldest idle ones dropped beyond it (when the pool is next used)."""
        self._returned.put((key, graphs))

    def idle_graphs(self) -> int:
        """Compiled graphs held idle now: ``COMPILED.idle_graphs()``."""
        with self._lock:
            self._file_queued()
            return self._count()

    def clear(self) -> None:
        """Drop every idle graph (their memory goes once nothing else holds them); live sets stay."""
        with self._lock:
            self._file_queued()
            self._idle.clear()

    def _leave(self, key: GraphKey, live: _LiveSet, *, wait: bool) -> None:
        """``GraphLease.release``: counted now (``wait=False``: when the lock is free, else when
        the pool is next used: a finalizer may run in a thread that holds it)."""
        self._left.put((key, live))
        if self._lock.acquire(blocking=wait):
            try:
                self._file_queued()
            finally:
                self._lock.release()

    def _take_idle(self, key: GraphKey) -> HeldGraphs | None:
        """Idle graphs for ``key``, taken out (``_lock`` held)."""
        held = self._idle.get(key)
        if not held:
            return None
        graphs = held.pop()
        if not held:
            del self._idle[key]
        return graphs

    def _file_queued(self) -> None:
        """Count the released leases (a set's last one hands it on once whole), move what was
        given back into ``_idle`` and drop the oldest beyond the limit (``_lock`` held)."""
        while not self._left.empty():
            key, live = self._left.get_nowait()
            live.users -= 1
            if live.users == 0 and self._live.get(key) is live:
                del self._live[key]
                _, whole = live.opened.result()
                whole.add_done_callback(partial(self._hand_on_whole, key))
        if self._returned.empty():
            return
        keep = keep_limit(strict=False)
        while not self._returned.empty():
            key, graphs = self._returned.get_nowait()
            self._idle.setdefault(key, []).append(graphs)
            self._idle.move_to_end(key)
        while self._idle and self._count() > keep:
            oldest = next(iter(self._idle))
            self._idle[oldest].pop(0)
            if not self._idle[oldest]:
                del self._idle[oldest]

    def _hand_on_whole(self, key: GraphKey, whole: Future[HeldGraphs]) -> None:
        """``give_back`` a set its last lease left once it is whole; a set an extra graph failed to
        compile is not handed on as if whole (it may run here, under ``_lock``: it only queues)."""
        if not whole.exception() and len(whole.result().compiled) == key.graphs:
            self.give_back(key, whole.result())

    def _count(self) -> int:
        """Idle graphs (``_lock`` held)."""
        return sum(len(g.compiled) for held in self._idle.values() for g in held)


def finished(held: HeldGraphs) -> Future[HeldGraphs]:
    """A future that already holds ``held``: graphs with nothing left to compile (no extra graph, or
    an idle set taken): ``finished(held).result() is held``."""
    done: Future[HeldGraphs] = Future()
    done.set_result(held)
    return done


def keep_limit(*, strict: bool = True) -> int:
    """``AGENTKV_KEEP_COMPILED`` as a count (0 when unset); a value that is not a whole number
    ``>= 0`` is a ``UserError`` (``strict=False``: 0, for a pool that must not raise)."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        if not strict:
            return 0
        raise UserError(f"{KEEP_ENV} must be a whole number of compiled graphs to keep (0 keeps none; an "
                        f"engine on the default model has 3), got {raw!r}")
    return value


COMPILED = CompiledPool()
"""The process's pool of live and idle compiled paged graphs."""
