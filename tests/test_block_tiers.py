"""The host tier (a byte-bounded LRU in process memory) and what every tier shares: key checks,
counters, rate-limited warnings."""

from __future__ import annotations

import logging
import threading

import pytest

from agentkv.errors import UserError
from agentkv.kvstore.block_tiers import BlockTier, HostBlocks, WarningLimiter, check_key

BAD_KEYS = ["../x", "A" * 32, "a" * 31, "a" * 33, "g" * 32, "0" * 31 + "\n", "", "ab/" + "0" * 29]


def key(n: int) -> str:
    return f"{n:032x}"


def test_a_block_put_in_host_memory_comes_back_and_can_be_removed():
    host = HostBlocks(max_bytes=1000)
    host.put(key(1), b"one")
    host.put(key(2), b"two!")
    assert host.get_many([key(1), key(2), key(3)]) == {key(1): b"one", key(2): b"two!"}
    assert host.has_many([key(1), key(3)]) == {key(1)}
    assert host.remove([key(1), key(3)]) == 3
    assert host.get_many([key(1)]) == {}
    assert [block.key for block in host.listing()] == [key(2)]


def test_the_host_tier_evicts_the_least_recently_used_block_and_keeps_the_one_just_read():
    host = HostBlocks(max_bytes=300)
    for n in range(3):
        host.put(key(n), bytes(100))
    assert host.get_many([key(0)]) == {key(0): bytes(100)}  # 0 is now the most recently used
    host.put(key(3), bytes(100))
    assert host.has_many([key(n) for n in range(4)]) == {key(0), key(2), key(3)}
    usage = host.usage()
    assert (usage.blocks, usage.nbytes, usage.evicted_blocks) == (3, 300, 1)


def test_asking_whether_a_block_is_held_does_not_make_it_recent():
    host = HostBlocks(max_bytes=200)
    host.put(key(0), bytes(100))
    host.put(key(1), bytes(100))
    assert host.has_many([key(0)]) == {key(0)}
    list(host.listing())
    host.put(key(2), bytes(100))
    assert host.has_many([key(0), key(1), key(2)]) == {key(1), key(2)}


def test_a_block_larger_than_the_host_bound_is_not_kept_and_evicts_nothing():
    host = HostBlocks(max_bytes=100)
    host.put(key(0), bytes(60))
    host.put(key(1), bytes(101))
    assert host.has_many([key(0), key(1)]) == {key(0)}
    assert host.usage().evicted_blocks == 0


def test_putting_a_held_key_again_writes_nothing_and_refreshes_it():
    host = HostBlocks(max_bytes=200)
    host.put(key(0), bytes(100))
    host.put(key(1), bytes(100))
    host.put(key(0), bytes(100))
    host.put(key(2), bytes(100))
    assert host.has_many([key(0), key(1), key(2)]) == {key(0), key(2)}
    assert host.usage().bytes_written == 300


def test_host_usage_counters_add_up_over_reads_and_writes():
    host = HostBlocks(max_bytes=10_000)
    host.put(key(0), b"abc")
    host.put(key(1), b"defgh")
    host.get_many([key(0), key(1), key(2)])
    host.get_many([key(0), key(9)])
    usage = host.usage()
    assert usage.tier == "host" and usage.max_bytes == 10_000
    assert (usage.hits, usage.misses) == (3, 2)
    assert (usage.bytes_read, usage.bytes_written) == (3 + 5 + 3, 8)
    assert (usage.blocks, usage.nbytes) == (2, 8)


def test_the_host_listing_gives_each_block_its_size_and_a_utc_insertion_time():
    host = HostBlocks(max_bytes=1000)
    host.put(key(5), b"12345")
    [block] = list(host.listing())
    assert (block.key, block.nbytes) == (key(5), 5)
    assert block.modified.utcoffset() is not None and block.modified.utcoffset().total_seconds() == 0


@pytest.mark.parametrize("bad", BAD_KEYS)
def test_a_key_that_is_not_32_lowercase_hex_digits_is_a_user_error_in_every_host_call(bad):
    host = HostBlocks(max_bytes=1000)
    for call in (lambda: host.put(bad, b"x"), lambda: host.get_many([bad]), lambda: host.has_many([bad]),
                 lambda: host.remove([bad]), lambda: check_key(bad)):
        with pytest.raises(UserError, match="32 lowercase hex digits"):
            call()


@pytest.mark.parametrize("bound", [0, -1, 1.5, True, None])
def test_a_host_bound_that_is_not_a_positive_int_is_a_user_error(bound):
    with pytest.raises(UserError, match="max_bytes"):
        HostBlocks(max_bytes=bound)


def test_host_data_that_is_not_bytes_is_a_user_error():
    with pytest.raises(UserError, match="must be bytes"):
        HostBlocks(max_bytes=1000).put(key(0), "text")  # type: ignore[arg-type]


def test_the_host_tier_keeps_its_bound_under_threads_putting_and_reading():
    host = HostBlocks(max_bytes=5_000)

    def work(offset: int) -> None:
        for n in range(200):
            host.put(key(offset + n), bytes(100))
            host.get_many([key(offset + n // 2)])

    threads = [threading.Thread(target=work, args=(1000 * i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    usage = host.usage()
    assert usage.nbytes <= 5_000 and usage.blocks == 50
    assert usage.evicted_blocks == 800 - 50
    assert sum(block.nbytes for block in host.listing()) == usage.nbytes


def test_the_host_tier_follows_the_tier_protocol():
    tier: BlockTier = HostBlocks(max_bytes=10)
    assert (tier.name, tier.persistent) == ("host", False)
    tier.check()


def test_the_warning_limiter_logs_one_line_per_topic_per_interval_and_says_how_many_it_held(caplog):
    limiter = WarningLimiter(interval=3600)
    log = logging.getLogger("agentkv.test.limiter")
    with caplog.at_level(logging.WARNING, logger="agentkv.test.limiter"):
        assert limiter.warn(log, "s3", "down: %s", "refused")
        assert not limiter.warn(log, "s3", "down: %s", "refused")
        assert limiter.warn(log, "disk", "full")
    assert [r.getMessage() for r in caplog.records] == ["down: refused", "full"]
    limiter.interval = 0
    with caplog.at_level(logging.WARNING, logger="agentkv.test.limiter"):
        limiter.warn(log, "s3", "down again")
    assert caplog.records[-1].getMessage() == "down again (1 more like it in the last 0 s not logged)"
