"""Canonical chunking: where a prefill is cut is a function of the token log, never of the path.

Where the plugin's numerics depend on chunking (dynamic quantisation, bf16 compute, a u8
cache), two prefills of the same tokens agree bit for bit only if they are cut at the same
places. So a prefill of log positions ``start..stop`` is cut at

- every registered prefix boundary inside it (system prompt + tool schemas: the places a
  prefix-cache hit can end), whether that prefix comes from the cache or is computed cold, and
- every multiple of ``prefill_chunk_size`` (absolute positions, not offsets from ``start``).

A prefix-cache hit (KV of ``prefix`` loaded, the rest fed) is then the same computation as a
cold start (``prefix`` fed, the rest fed)::

    boundaries = PrefixBoundaries()
    boundaries.register(system_ids)
    cuts = boundaries.cuts_within(prompt, start=0, stop=len(prompt))   # [len(system_ids)]
    chunk_spans(0, len(prompt), cuts=cuts, chunk_size=None)            # [(0, 120), (120, 160)]
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from cachetools import LRUCache

from agentkv.errors import UserError

DEFAULT_MAX_REGISTERED = 256


class PrefixBoundaries:
    """Registered shared prefixes, by tenant salt; the least recently registered go beyond
    ``max_registered`` per salt. Thread-safe."""

    def __init__(self, max_registered: int = DEFAULT_MAX_REGISTERED) -> None:
        self._max = max_registered
        self._lock = threading.Lock()
        self._marks: dict[str, LRUCache[tuple[int, ...], None]] = {}

    def register(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Make ``tokens`` a boundary (mutates; registering again refreshes it)."""
        key = tuple(int(t) for t in tokens)
        if not key:
            raise UserError("register() needs at least one token: pass the prefix's ids")
        with self._lock:
            marks = self._marks.setdefault(salt, LRUCache(maxsize=self._max))
            marks[key] = None  # most recent now; beyond the bound, the least recently registered goes

    def prefixes_of(self, tokens: Sequence[int], *, salt: str = "") -> list[tuple[int, ...]]:
        """Registered prefixes of ``tokens`` under ``salt``, shortest first (read-only)."""
        with self._lock:
            marks = list(self._marks.get(salt, ()))
        return sorted((m for m in marks if _is_prefix(m, tokens)), key=len)

    def cuts_within(self, tokens: Sequence[int], *, start: int, stop: int) -> list[int]:
        """Boundary positions ``p`` with ``start < p < stop`` that prefix ``tokens`` (any salt:
        a cut never changes what is computed, only how it is grouped), ascending."""
        with self._lock:
            marks = [m for ns in self._marks.values() for m in ns if start < len(m) < stop]
        return sorted({len(m) for m in marks if _is_prefix(m, tokens)})


def chunk_spans(start: int, stop: int, *, cuts: Iterable[int] = (), chunk_size: int | None = None
                ) -> list[tuple[int, int]]:
    """Absolute ``(begin, end)`` spans covering ``start..stop``, cut at ``cuts`` and at every
    multiple of ``chunk_size``: ``chunk_spans(5, 20, cuts=[12], chunk_size=8) == [(5, 8), (8, 12),
    (12, 16), (16, 20)]``."""
    points = {p for p in cuts if start < p < stop}
    if chunk_size:
        first = (start // chunk_size + 1) * chunk_size
        points.update(range(first, stop, chunk_size))
    edges = [start, *sorted(points), stop]
    return [(a, b) for a, b in zip(edges, edges[1:]) if b > a]


def _is_prefix(mark: tuple[int, ...], tokens: Sequence[int]) -> bool:
    n = len(mark)
    return n <= len(tokens) and mark[-1] == tokens[n - 1] and mark == tuple(tokens[:n])
