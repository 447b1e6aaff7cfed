"""The KV store's /metrics families: per-tier holdings, hits and misses, and the write-behind queue."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agentkv.kvstore.block_files import DiskBlocks
from agentkv.memory.block_metrics import BlockStoreCollector
from agentkv.kvstore.block_store import BlockStore
from agentkv.kvstore.block_tiers import HostBlocks
from agentkv.observe.metrics import registry_of


def scrape(store: BlockStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry_of(BlockStoreCollector(store))).decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def test_a_scrape_reads_each_tiers_blocks_hits_misses_and_the_queue(tmp_path: Path) -> None:
    store = BlockStore([HostBlocks(1 << 20), DiskBlocks(tmp_path / "blocks")])
    try:
        host, disk = store.tiers
        host.put("a" * 32, b"x" * 100)
        disk.put("b" * 32, b"y" * 50)
        host.get_many(["a" * 32, "c" * 32])
        got = scrape(store)
        assert got[("agentkv_kv_store_blocks", (("tier", "host"),))] == 1
        assert got[("agentkv_kv_store_bytes", (("tier", "disk"),))] == disk.usage().nbytes > 0
        assert got[("agentkv_kv_store_hits_total", (("tier", "host"),))] == 1
        assert got[("agentkv_kv_store_misses_total", (("tier", "host"),))] == 1
        assert got[("agentkv_kv_store_max_bytes", (("tier", "host"),))] == 1 << 20
        assert ("agentkv_kv_store_max_bytes", (("tier", "disk"),)) not in got  # unbounded
        assert got[("agentkv_kv_store_write_behind_pending_bytes", ())] == 0
        assert got[("agentkv_kv_store_corrupt_blocks_total", ())] == 0
    finally:
        store.close()


def test_a_store_without_persistent_tiers_has_no_queue_metrics() -> None:
    store = BlockStore([HostBlocks(1 << 20)])
    assert not any(name.startswith("agentkv_kv_store_write_behind") for name, _ in scrape(store))
