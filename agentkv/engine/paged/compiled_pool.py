"""Compiled paged graphs kept in this process for the next engine on the same model and settings.

OpenVINO's compiled-blob cache cannot hold a PagedAttention graph (its import loses the ops'
head sizes and the plugin compiles again: ``model.py``), so each paged engine compiles its graphs,
~3.6 s each for the default model on 2 cores. An engine closed hands its graphs here; the next
``PagedModel`` asking for the same key takes them instead of compiling. Off unless
``AGENTKV_KEEP_COMPILED`` says how many idle graphs to keep (each holds its compiled weights,
~210 MB for the default model): a test suite, a notebook or a script that reopens engines::

    key = GraphKey.of(files, "CPU", config, "f16", graphs=2)
    held = COMPILED.take(key)            # None, or the graphs an engine released
    ...
    COMPILED.give_back(key, held)        # kept while the limit allows, the oldest dropped first
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from dataclasses import dataclass

import openvino as ov

from agentkv.engine.openvino.models import ModelFiles
from agentkv.errors import UserError

KEEP_ENV = "AGENTKV_KEEP_COMPILED"
"""Idle compiled graphs this process keeps (default 0: an engine's graphs go with it)."""


@dataclass(frozen=True)
class GraphKey:
    """What a compiled paged graph depends on: the model files as they are on disk now, the
    device, the plugin config and the KV blocks' element type, and how many graphs are asked."""

    model_xml: str
    files_stat: tuple[int, int, int, int]
    device: str
    config: tuple[tuple[str, str], ...]
    kv_cache_precision: str
    graphs: int

    @classmethod
    def of(cls, files: ModelFiles, device: str, config: dict[str, str], kv_cache_precision: str, *,
           graphs: int) -> GraphKey:
        """The key for ``files`` compiled on ``device`` with ``config``: ``GraphKey.of(files, "CPU", {}, "f16", graphs=2)``."""
        xml = files.model_xml.resolve()
        weights = xml.with_suffix(".bin")
        xml_stat = xml.stat()
        bin_stat = weights.stat() if weights.is_file() else None
        stat = (xml_stat.st_mtime_ns, xml_stat.st_size,
                bin_stat.st_mtime_ns if bin_stat else 0, bin_stat.st_size if bin_stat else 0)
        return cls(str(xml), stat, device.upper(), tuple(sorted((k, str(v)) for k, v in config.items())),
                   kv_cache_precision, graphs)


@dataclass(frozen=True)
class HeldGraphs:
    """The compiled graphs of one ``PagedModel`` and what it read from the model to build them."""

    compiled: tuple[ov.CompiledModel, ...]
    """The decode graph, then the chunk graph if there is one."""
    heads: int
    head_dim: int
    num_layers: int


class CompiledPool:
    """Idle ``HeldGraphs`` by key, the most recently given back last. Thread-safe."""

    def __init__(self) -> None:
        self._idle: OrderedDict[GraphKey, list[HeldGraphs]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: GraphKey) -> HeldGraphs | None:
        """Idle graphs for ``key`` (now the caller's), or None."""
        with self._lock:
            held = self._idle.get(key)
            if not held:
                return None
            graphs = held.pop()
            if not held:
                del self._idle[key]
            return graphs

    def give_back(self, key: GraphKey, graphs: HeldGraphs) -> None:
        """Keep ``graphs`` for the next ``take(key)`` while ``AGENTKV_KEEP_COMPILED`` allows,
        dropping the oldest idle ones beyond it."""
        keep = keep_limit()
        with self._lock:
            self._idle.setdefault(key, []).append(graphs)
            self._idle.move_to_end(key)
            while self._idle and self._count() > keep:
                oldest = next(iter(self._idle))
                self._idle[oldest].pop(0)
                if not self._idle[oldest]:
                    del self._idle[oldest]

    def idle_graphs(self) -> int:
        """Compiled graphs held idle now: ``COMPILED.idle_graphs()``."""
        with self._lock:
            return self._count()

    def _count(self) -> int:
        """Idle graphs (``_lock`` held)."""
        return sum(len(g.compiled) for held in self._idle.values() for g in held)

    def clear(self) -> None:
        """Drop every idle graph (their memory goes once nothing else holds them)."""
        with self._lock:
            self._idle.clear()


def keep_limit() -> int:
    """``AGENTKV_KEEP_COMPILED`` as a count (0 when unset)."""
    raw = os.environ.get(KEEP_ENV, "").strip()
    if not raw:
        return 0
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{KEEP_ENV} must be a whole number of compiled graphs to keep (0 keeps none), got {raw!r}")
    return value


COMPILED = CompiledPool()
"""The process's pool of idle compiled paged graphs."""
