"""What the prefix caches report and read: ``PrefixCacheStats`` (counters and size, the same
for the host radix tree and the paged block cache) and the session and slot views ``capture``
reads::

    stats = engine.prefix_cache.stats()
    print(stats.hits, stats.hit_tokens, stats.bytes)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np


class CapturableSession(Protocol):
    """What ``capture`` reads from a session."""

    @property
    def tokens(self) -> tuple[int, ...]: ...

    @property
    def shifted(self) -> bool: ...

    @property
    def kv_exact(self) -> bool: ...


class ReadableSlot(Protocol):
    """What ``capture`` reads from a slot (blocking)."""

    def read(self) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class PrefixCacheStats:
    """Counters since the cache was made, and its size now."""

    hits: int
    """Lookups that returned KV."""
    misses: int
    """Lookups that found nothing longer than what the session already held."""
    hit_tokens: int
    """Tokens the hits supplied beyond what the sessions already held (prefill skipped)."""
    inserted_tokens: int
    bytes: int
    """Bytes held now (never above ``budget_bytes``)."""
    budget_bytes: int | None
    nodes: int
    evictions: int
    evicted_bytes: int
