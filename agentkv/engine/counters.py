"""EngineCounters: what an engine holds and has done, read when ``/metrics`` is scraped::

    engine.counters().kv_blocks_used
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCounters:
    """What an engine holds and has done, read when metrics are scraped."""

    kv_blocks_used: int
    """KV blocks held by sessions, forks and cached prefixes (the stateful form: slots bound)."""
    kv_blocks_total: int
    """KV blocks the engine has (the stateful form: slots)."""
    kv_blocks_active: int
    """Blocks of sessions running a call, plus those reserved for a step (stateful: slots leased)."""
    kv_blocks_evictable: int
    """Held blocks freed on demand, failing no call: only cached prefixes, unrun forks or idle
    sessions (to host) hold them (stateful: bound slots not leased)."""
    model_steps: int
    """Forward passes run since the engine was made."""
    prefix_cache_hit_tokens: int
    """Prompt tokens the prefix cache supplied (prefill skipped)."""
