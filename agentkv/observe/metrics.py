"""Prometheus metrics read from the counters agentkv already keeps: a ``prometheus_client``
collector that, on each scrape, reads the server's load and the engine's ``counters()`` (nothing
is counted twice).

Queued and running requests and KV-cache utilisation carry the names of the Gateway API Inference
Extension's model-server protocol (the defaults its endpoint picker scrapes, vLLM's:
``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``), so a
router that balances vLLM balances agentkv unchanged; the rest (live conversations, KV blocks,
prefix-cache hit tokens, KV snapshot saves and restores) have no name there and are ``agentkv_*``::

    collector = ServerCollector(engine, lambda: ServerLoad(running=2, waiting=0, live_conversations=5))
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry)          # GET /metrics
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from agentkv.engine.base import Engine
from agentkv.engine.counters import EngineCounters

SNAPSHOT_SAVES = "agentkv_snapshot_saves"
"""KV snapshots saved (counter; exposed with ``_total``)."""
SNAPSHOT_RESTORES = "agentkv_snapshot_restores"
"""KV snapshots restored into a session (counter; exposed with ``_total``)."""
QUEUED_REQUESTS = "vllm:num_requests_waiting"
"""The model-server protocol's TotalQueuedRequests (gauge)."""
RUNNING_REQUESTS = "vllm:num_requests_running"
"""The model-server protocol's TotalRunningRequests (gauge)."""
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
"""The model-server protocol's KVCacheUtilization (gauge, 0..1: the fraction of KV blocks in use)."""


@dataclass(frozen=True)
class ServerLoad:
    """What the server holds now."""

    running: int
    """Requests admitted and holding their KV session."""
    waiting: int
    """Requests admitted and still waiting for their KV session."""
    live_conversations: int
    """Conversations whose KV the server keeps between requests (live chat sessions and open
    stored conversations)."""


@dataclass
class SnapshotCounts:
    """KV snapshots saved and restored by this process (``runtime.persistence`` counts them)::

        SNAPSHOTS.saves += 1
    """

    saves: int = 0
    restores: int = 0


SNAPSHOTS = SnapshotCounts()
"""The process's snapshot counts (one per process: every store and app in it adds to them)."""
CACHED_PROMPT_TOKENS = "agentkv_prompt_cached_tokens"
"""Prompt tokens of answered requests whose KV was reused instead of computed (counter; ``_total``)."""


@dataclass
class ServedCounts:
    """What one server's answered requests add up to (its access log adds each request)::

        served.cached_prompt_tokens += 120
    """

    cached_prompt_tokens: int = 0


class ServerCollector(Collector):
    """Reads ``load()``, the engine's counters and the snapshot counts on every scrape (see the
    module docstring)."""

    def __init__(self, engine: Engine, load: Callable[[], ServerLoad],
                 snapshots: SnapshotCounts = SNAPSHOTS, served: ServedCounts | None = None) -> None:
        self.engine = engine
        self.load = load
        self.snapshots = snapshots
        self.served = served or ServedCounts()

    def collect(self) -> Iterator[Metric]:
        """The metric families now."""
        load = self.load()
        yield GaugeMetricFamily(QUEUED_REQUESTS, "Requests waiting for their KV session.", value=load.waiting)
        yield GaugeMetricFamily(RUNNING_REQUESTS, "Requests running on their KV session.", value=load.running)
        yield GaugeMetricFamily("agentkv_live_conversations", "Conversations whose KV is kept between requests.",
                                value=load.live_conversations)
        yield CounterMetricFamily(SNAPSHOT_SAVES, "KV snapshots saved (after a turn, on offload, on shutdown).",
                                  value=self.snapshots.saves)
        yield CounterMetricFamily(SNAPSHOT_RESTORES, "KV snapshots restored into a conversation resumed here.",
                                  value=self.snapshots.restores)
        yield CounterMetricFamily(CACHED_PROMPT_TOKENS, "Prompt tokens whose KV was reused (a live session, a restored "
                                  "snapshot or the prefix cache) instead of computed.",
                                  value=self.served.cached_prompt_tokens)
        yield from engine_metrics(self.engine.counters())


def engine_metrics(counters: EngineCounters) -> Iterator[Metric]:
    """The metric families of an engine's ``counters``::

        families = list(engine_metrics(engine.counters()))
    """
    total = counters.kv_blocks_total
    # NOTE: as vLLM's: blocks only cached prefixes or idle conversations hold are not in use
    # (agentkv keeps them by design and frees them on demand), else the gauge nears 1 at rest
    yield GaugeMetricFamily(KV_CACHE_USAGE, "Fraction of the KV cache's blocks running calls need (0..1).",
                            value=counters.kv_blocks_active / total if total else 0.0)
    yield GaugeMetricFamily("agentkv_kv_blocks_used", "KV blocks held by sessions, forks and cached prefixes.",
                            value=counters.kv_blocks_used)
    yield GaugeMetricFamily("agentkv_kv_blocks_free", "KV blocks free.", value=total - counters.kv_blocks_used)
    yield GaugeMetricFamily("agentkv_kv_blocks_evictable",
                            "KV blocks held only by cached prefixes, unrun forks or idle sessions: freed on demand.",
                            value=counters.kv_blocks_evictable)
    yield CounterMetricFamily("agentkv_model_steps", "Forward passes of the model.", value=counters.model_steps)
    yield CounterMetricFamily("agentkv_prefix_cache_hit_tokens", "Prompt tokens the prefix cache supplied.",
                              value=counters.prefix_cache_hit_tokens)


def registry_of(collector: Collector) -> CollectorRegistry:
    """A registry of its own holding ``collector`` (not the process-wide default one, so two apps
    in one process never share or clash)::

        text = generate_latest(registry_of(collector))
    """
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
