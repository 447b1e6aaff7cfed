"""Prometheus metrics of the KV store's blocks: what each tier holds, hits and misses, bytes written, the queue.

A ``prometheus_client`` collector reading ``BlockStore.usage()`` on each scrape (nothing counted
twice); every family carries a ``tier`` label ("host", "disk", "s3")::

    registry.register(BlockStoreCollector(store.blocks))
    # agentkv_kv_store_blocks{tier="disk"} 412
    # agentkv_kv_store_hits_total{tier="host"} 96
    # agentkv_kv_store_write_behind_pending_bytes 1.2e+06
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agentkv.kvstore.block_store import BlockStore

__all__ = ["BlockStoreCollector"]

_PREFIX = "agentkv_kv_store_"


class BlockStoreCollector(Collector):
    """The metrics of ``blocks`` (see the module docstring)."""

    def __init__(self, blocks: BlockStore) -> None:
        self.blocks = blocks

    def collect(self) -> Iterator[Metric]:
        usage = self.blocks.usage()
        gauges = {"blocks": "KV blocks a tier holds (-1: unknown without listing it).",
                  "bytes": "Bytes of KV blocks a tier holds (-1: unknown without listing it).",
                  "max_bytes": "The byte bound of a tier (absent: unbounded)."}
        counters = {"hits": "Blocks asked of a tier that it returned.",
                    "misses": "Blocks asked of a tier that it did not hold (or could not read).",
                    "read_bytes": "Bytes of blocks a tier returned.",
                    "written_bytes": "Bytes of blocks written to a tier.",
                    "evicted_blocks": "Blocks a bounded tier removed to stay under its bound."}
        fields = {"blocks": "blocks", "bytes": "nbytes", "max_bytes": "max_bytes", "hits": "hits",
                  "misses": "misses", "read_bytes": "bytes_read", "written_bytes": "bytes_written",
                  "evicted_blocks": "evicted_blocks"}
        families: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            **{name: GaugeMetricFamily(_PREFIX + name, text, labels=["tier"]) for name, text in gauges.items()},
            **{name: CounterMetricFamily(_PREFIX + name, text, labels=["tier"]) for name, text in counters.items()},
        }
        for tier in usage.tiers:
            for name, family in families.items():
                value = getattr(tier, fields[name])
                if value is not None:
                    family.add_metric([tier.tier], float(value))
        yield from families.values()
        yield CounterMetricFamily(_PREFIX + "corrupt_blocks", "Blocks read that failed their checks (re-prefilled).",
                                  value=usage.corrupt_blocks)
        queue = usage.write_behind
        if queue is None:
            return
        yield GaugeMetricFamily(_PREFIX + "write_behind_pending_blocks", "Blocks queued for the persistent tiers.",
                                value=queue.pending_blocks)
        yield GaugeMetricFamily(_PREFIX + "write_behind_pending_bytes", "Bytes queued for the persistent tiers.",
                                value=queue.pending_bytes)
        for name, value, text in (
                ("write_behind_written_blocks", queue.written_blocks, "Queued blocks every persistent tier holds."),
                ("write_behind_dropped_blocks", queue.dropped_blocks, "Queued blocks never written (queue full)."),
                ("write_behind_failed_blocks", queue.failed_blocks, "Queued blocks a tier failed to write.")):
            yield CounterMetricFamily(_PREFIX + name, text, value=value)
