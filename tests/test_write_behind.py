"""The write-behind queue: blocks reach the persistent tiers off the caller's path, in order, once;
back-pressure on a full queue; failing tiers counted and dropped, never retried forever."""

from __future__ import annotations

import logging
import threading
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import UserError
from agentkv.kvstore.block_files import DiskBlocks
from agentkv.kvstore.block_tiers import BlockTierUnavailable, StoredBlock, TierUsage
from agentkv.kvstore.write_behind import WriteBehind

WAIT = 10.0  # upper bound for a gate or a flush: a test that needs it has failed


def key(n: int) -> str:
    return f"{n:032x}"


class FakeTier:
    """A persistent tier in a dict; ``gate`` (when given) holds every put until it is set."""

    persistent = True

    def __init__(self, name: str = "disk", *, gate: threading.Event | None = None, fail: bool = False,
                 fail_keys: frozenset[str] = frozenset()) -> None:
        self.name = name
        self.gate = gate
        self.fail = fail
        self.fail_keys = fail_keys
        self.blocks: dict[str, bytes] = {}
        self.puts: Counter[str] = Counter()
        self.order: list[str] = []
        self.entered = threading.Event()

    def get_many(self, keys):
        return {k: self.blocks[k] for k in keys if k in self.blocks}

    def has_many(self, keys):
        return {k for k in keys if k in self.blocks}

    def put(self, key, data):
        self.entered.set()
        if self.gate is not None:
            assert self.gate.wait(WAIT)
        if self.fail or key in self.fail_keys:
            raise BlockTierUnavailable(f"the fake {self.name} tier is down")
        self.puts[key] += 1
        self.order.append(key)
        self.blocks[key] = bytes(data)

    def remove(self, keys):
        return sum(len(self.blocks.pop(k, b"")) for k in keys)

    def listing(self):
        return iter([StoredBlock(k, len(v), None) for k, v in self.blocks.items()])  # type: ignore[arg-type]

    def usage(self):
        return TierUsage(self.name, len(self.blocks), 0, None, 0, 0, 0, 0, 0)

    def check(self):
        pass


def submit_in_thread(behind: WriteBehind, k: str, data: bytes, **kwargs) -> tuple[threading.Thread, list[bool]]:
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(behind.submit(k, data, **kwargs)))
    thread.start()
    return thread, answer


def test_submit_returns_before_the_tier_write_finishes_and_flush_waits_for_it():
    gate = threading.Event()
    tier = FakeTier(gate=gate)
    with WriteBehind([tier], max_pending_bytes=1 << 20) as behind:
        for n in range(3):
            assert behind.submit(key(n), bytes([n]) * 10)
        assert tier.entered.wait(WAIT)  # a worker is inside put, held by the gate
        assert tier.blocks == {}
        assert behind.pending() == (3, 30)
        assert not behind.flush(timeout=0.01)
        gate.set()
        assert behind.flush(timeout=WAIT)
    assert tier.blocks == {key(n): bytes([n]) * 10 for n in range(3)}
    usage = behind.usage()
    assert (usage.pending_blocks, usage.pending_bytes, usage.written_blocks, usage.written_bytes) == (0, 0, 3, 30)


def test_one_worker_writes_the_blocks_in_the_order_they_were_submitted():
    tier = FakeTier()
    with WriteBehind([tier], max_pending_bytes=1 << 20, workers=1) as behind:
        for n in reversed(range(20)):
            behind.submit(key(n), b"x")
        assert behind.flush(WAIT)
    assert tier.order == [key(n) for n in reversed(range(20))]


def test_a_full_queue_holds_submit_until_the_tier_drains_it():
    gate = threading.Event()
    tier = FakeTier(gate=gate)
    with WriteBehind([tier], max_pending_bytes=100, workers=1) as behind:
        behind.submit(key(0), bytes(60))
        thread, answer = submit_in_thread(behind, key(1), bytes(60), timeout=None)
        thread.join(0.2)
        assert thread.is_alive() and answer == []  # 60 + 60 > 100 bytes: waits
        assert behind.pending() == (1, 60)
        gate.set()
        thread.join(WAIT)
        assert answer == [True]
        assert behind.flush(WAIT)
    assert set(tier.blocks) == {key(0), key(1)}


def test_a_queue_that_stays_full_past_the_timeout_drops_the_block_with_a_warning(caplog):
    gate = threading.Event()
    tier = FakeTier(gate=gate)
    with WriteBehind([tier], max_pending_bytes=100, workers=1) as behind:
        behind.submit(key(0), bytes(100))
        with caplog.at_level(logging.WARNING, logger="agentkv.kvstore.write_behind"):
            assert behind.submit(key(1), bytes(10), timeout=0.05) is False
        assert behind.usage().dropped_blocks == 1
        assert "raise max_pending_bytes" in caplog.records[-1].getMessage()
        gate.set()
    assert set(tier.blocks) == {key(0)}


def test_a_block_larger_than_the_bound_is_written_once_the_queue_is_empty():
    tier = FakeTier()
    with WriteBehind([tier], max_pending_bytes=10) as behind:
        assert behind.submit(key(0), bytes(50), timeout=WAIT)
        assert behind.flush(WAIT)
    assert tier.blocks == {key(0): bytes(50)}


def test_a_key_queued_or_in_flight_is_not_queued_twice_and_is_written_once():
    gate = threading.Event()
    tier = FakeTier(gate=gate)
    with WriteBehind([tier], max_pending_bytes=1 << 20, workers=1) as behind:
        behind.submit(key(0), b"a")
        assert tier.entered.wait(WAIT)  # 0 in flight
        behind.submit(key(1), b"b")  # 1 queued
        assert behind.submit(key(0), b"a") and behind.submit(key(1), b"b")
        assert behind.pending() == (2, 2)
        gate.set()
        assert behind.flush(WAIT)
        behind.submit(key(0), b"a")  # written already: the tier reports it, no second put
        assert behind.flush(WAIT)
    assert tier.puts == {key(0): 1, key(1): 1}
    assert behind.usage().written_blocks == 3 and behind.usage().written_bytes == 2


def test_a_failing_tier_counts_its_failures_drops_the_blocks_and_the_other_tier_still_gets_them(caplog):
    down, up = FakeTier("s3", fail=True), FakeTier("disk")
    with caplog.at_level(logging.WARNING, logger="agentkv.kvstore.write_behind"):
        with WriteBehind([down, up], max_pending_bytes=1 << 20) as behind:
            for n in range(5):
                behind.submit(key(n), b"kv")
            assert behind.flush(WAIT)
            assert behind.pending() == (0, 0)
    assert set(up.blocks) == {key(n) for n in range(5)} and down.blocks == {}
    usage = behind.usage()
    assert (usage.failed_blocks, usage.written_blocks, usage.written_bytes) == (5, 0, 10)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "the s3 tier failed" in lines[0]  # one line a minute per tier, not one per block


def test_close_is_idempotent_and_a_block_submitted_after_it_is_dropped_not_raised():
    tier = FakeTier()
    behind = WriteBehind([tier], max_pending_bytes=1 << 20)
    behind.submit(key(0), b"x")
    assert behind.close(WAIT)
    assert behind.close(WAIT)
    assert behind.submit(key(1), b"y") is False
    assert set(tier.blocks) == {key(0)} and behind.usage().dropped_blocks == 1


def test_close_with_a_stuck_tier_gives_up_after_its_timeout_and_counts_what_it_dropped():
    gate = threading.Event()
    tier = FakeTier(gate=gate)
    behind = WriteBehind([tier], max_pending_bytes=1 << 20, workers=1)
    behind.submit(key(0), b"x")
    behind.submit(key(1), b"y")
    assert tier.entered.wait(WAIT)
    assert behind.close(timeout=0.05) is False
    assert behind.usage().dropped_blocks == 1  # 1 was still queued; 0 is in flight
    gate.set()
    assert behind.flush(WAIT)
    assert set(tier.blocks) == {key(0)}


def test_blocks_reach_a_real_disk_tier_through_the_queue(tmp_path):
    disk = DiskBlocks(tmp_path)
    with WriteBehind([disk], max_pending_bytes=1 << 20) as behind:
        for n in range(10):
            behind.submit(key(n), bytes([n]) * 100)
    assert disk.get_many([key(n) for n in range(10)]) == {key(n): bytes([n]) * 100 for n in range(10)}


def test_bad_keys_data_and_settings_are_user_errors():
    with pytest.raises(UserError, match="max_pending_bytes"):
        WriteBehind([], max_pending_bytes=0)
    with pytest.raises(UserError, match="workers"):
        WriteBehind([], max_pending_bytes=10, workers=0)
    with WriteBehind([], max_pending_bytes=10) as behind:
        with pytest.raises(UserError, match="32 lowercase hex digits"):
            behind.submit("../etc/passwd", b"x")
        with pytest.raises(UserError, match="must be bytes"):
            behind.submit(key(0), "text")  # type: ignore[arg-type]


@settings(max_examples=25, deadline=None)
@given(submissions=st.lists(st.tuples(st.integers(0, 15), st.integers(1, 40)), max_size=40),
       bound=st.sampled_from([30, 200, 1 << 20]), failing=st.frozensets(st.integers(0, 15), max_size=4))
def test_every_submitted_block_is_written_once_or_counted_as_dropped_or_failed(submissions, bound, failing):
    flaky = FakeTier("s3", fail_keys=frozenset(key(n) for n in failing))
    good = FakeTier("disk")
    behind = WriteBehind([flaky, good], max_pending_bytes=bound)
    accepted = [k for k, size in ((key(n), size) for n, size in submissions)
                if behind.submit(k, bytes(size), timeout=0)]
    assert behind.close(WAIT)
    usage = behind.usage()
    assert max(good.puts.values(), default=1) == 1 and max(flaky.puts.values(), default=1) == 1
    assert set(good.blocks) == set(accepted)
    assert usage.dropped_blocks == len(submissions) - len(accepted)
    failed_keys = {k for k in accepted if k in flaky.fail_keys}
    assert set(flaky.blocks) == set(accepted) - failed_keys
    assert (usage.failed_blocks > 0) == bool(failed_keys)
    assert usage.written_blocks + usage.failed_blocks <= len(accepted)
