"""Compiled paged graphs kept in this process for the next engine on the same model and settings.

OpenVINO's compiled-blob cache cannot hold a PagedAttention graph (its import loses the ops'
head sizes and the plugin compiles again: ``graphs.py``), so each paged engine compiles its graphs,
~3.6 s each for the default model on 2 cores (in parallel: its three in 5–6 s). An engine closed
hands its graphs here; the next ``PagedModel`` asking for the same key takes them instead of
compiling. Off unless ``AGENTKV_KEEP_COMPILED`` says how many idle graphs to keep (each holds its
compiled weights, ~80–130 MB for the default model): a test suite, a notebook or a script that
reopens engines::

    key = GraphKey.of(files, "CPU", config, "f16", graphs=3)
    held = COMPILED.take(key)            # None, or the graphs an engine released
    ...
    COMPILED.give_back(key, held)        # kept while the limit allows, the oldest dropped first

Only whole sets are kept: ``AGENTKV_KEEP_COMPILED`` below an engine's graph count (3 for the default model)
keeps none of it.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass
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


class CompiledPool:
    """Idle ``HeldGraphs`` by key, the most recently given back last. Thread-safe, and
    ``give_back`` may run in a garbage collection (a ``weakref.finalize``): it only queues."""

    def __init__(self) -> None:
        self._idle: OrderedDict[GraphKey, list[HeldGraphs]] = OrderedDict()
        self._lock = threading.Lock()
        self._returned: queue.SimpleQueue[tuple[GraphKey, HeldGraphs]] = queue.SimpleQueue()
        """Given back, not filed yet. NOTE: a collection may run a finalizer in a thread that holds
        ``_lock``, so ``give_back`` never takes it (``SimpleQueue.put`` is safe there)."""

    def take(self, key: GraphKey) -> HeldGraphs | None:
        """Idle graphs for ``key`` (now the caller's), or None."""
        with self._lock:
            self._file_returned()
            held = self._idle.get(key)
            if not held:
                return None
            graphs = held.pop()
            if not held:
                del self._idle[key]
            return graphs

    def give_back(self, key: GraphKey, graphs: HeldGraphs) -> None:
        """Hand ``graphs`` on: kept for the next ``take(key)`` while ``AGENTKV_KEEP_COMPILED``
        allows, the oldest idle ones dropped beyond it (when the pool is next used)."""
        self._returned.put((key, graphs))

    def idle_graphs(self) -> int:
        """Compiled graphs held idle now: ``COMPILED.idle_graphs()``."""
        with self._lock:
            self._file_returned()
            return self._count()

    def clear(self) -> None:
        """Drop every idle graph (their memory goes once nothing else holds them)."""
        with self._lock:
            self._file_returned()
            self._idle.clear()

    def _file_returned(self) -> None:
        """Move what was given back into ``_idle`` and drop the oldest beyond the limit (``_lock`` held)."""
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

    def _count(self) -> int:
        """Idle graphs (``_lock`` held)."""
        return sum(len(g.compiled) for held in self._idle.values() for g in held)


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
"""The process's pool of idle compiled paged graphs."""
