"""The disk tier: block files on a real directory, LRU eviction by bytes through file mtimes, bad
files as misses, two instances on one directory, a full disk."""

from __future__ import annotations

import errno
import os
import time

import pytest

from agentkv.errors import UserError
from agentkv.kvstore.block_files import BLOCK_SUFFIX, DiskBlocks
from agentkv.kvstore.block_tiers import BlockTier, BlockTierUnavailable

HEADER = 32  # bytes before the block in every file (block_files' header)


def key(n: int) -> str:
    return f"{n:032x}"


def age(disk: DiskBlocks, k: str, seconds_ago: float) -> None:
    """Set a block's mtime into the past (recency is the mtime; tests must not sleep for it)."""
    when = time.time() - seconds_ago
    os.utime(disk.path(k), (when, when))


def files_under(root) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_a_block_written_to_disk_comes_back_and_can_be_removed(tmp_path):
    disk = DiskBlocks(tmp_path / "kv")
    disk.put(key(1), b"one")
    disk.put(key(2), b"two!")
    assert disk.path(key(1)) == tmp_path / "kv" / "00" / f"{key(1)}{BLOCK_SUFFIX}"
    assert disk.get_many([key(1), key(2), key(3)]) == {key(1): b"one", key(2): b"two!"}
    assert disk.has_many([key(1), key(3)]) == {key(1)}
    assert disk.remove([key(1), key(3)]) == 3 + HEADER
    assert disk.get_many([key(1)]) == {}
    assert files_under(tmp_path / "kv") == [f"{key(2)}{BLOCK_SUFFIX}"]


def test_the_disk_tier_evicts_the_least_recently_read_file_and_keeps_the_one_just_read(tmp_path):
    disk = DiskBlocks(tmp_path, max_bytes=3 * (100 + HEADER))
    for n in range(3):
        disk.put(key(n), bytes(100))
        age(disk, key(n), 100 - n)  # written in order 0, 1, 2
    disk = DiskBlocks(tmp_path, max_bytes=3 * (100 + HEADER))  # a new process: its index comes from a scan
    assert disk.get_many([key(0)]) == {key(0): bytes(100)}  # the read touches 0's mtime
    disk.put(key(3), bytes(100))
    assert disk.has_many([key(n) for n in range(4)]) == {key(0), key(2), key(3)}
    usage = disk.usage()
    assert (usage.blocks, usage.nbytes, usage.evicted_blocks) == (3, 3 * (100 + HEADER), 1)


def test_a_block_larger_than_the_disk_bound_is_not_written(tmp_path):
    disk = DiskBlocks(tmp_path, max_bytes=200)
    disk.put(key(0), bytes(100))
    disk.put(key(1), bytes(200))
    assert disk.has_many([key(0), key(1)]) == {key(0)}
    assert disk.usage().evicted_blocks == 0


def test_putting_a_block_already_on_disk_writes_nothing(tmp_path):
    disk = DiskBlocks(tmp_path)
    disk.put(key(0), b"abc")
    before = disk.path(key(0)).stat().st_ino
    disk.put(key(0), b"abc")
    assert disk.path(key(0)).stat().st_ino == before
    assert disk.usage().bytes_written == 3 + HEADER


def test_disk_usage_counters_add_up_over_reads_and_writes(tmp_path):
    disk = DiskBlocks(tmp_path, max_bytes=10_000)
    disk.put(key(0), b"abc")
    disk.put(key(1), b"defgh")
    disk.get_many([key(0), key(1), key(2)])
    disk.get_many([key(0), key(9)])
    usage = disk.usage()
    assert usage.tier == "disk" and usage.max_bytes == 10_000
    assert (usage.hits, usage.misses) == (3, 2)
    assert (usage.bytes_read, usage.bytes_written) == (3 + 5 + 3, 8 + 2 * HEADER)
    assert (usage.blocks, usage.nbytes) == (2, 8 + 2 * HEADER)


def test_a_truncated_block_file_is_a_miss_that_is_logged_once_and_removed(tmp_path, caplog):
    disk = DiskBlocks(tmp_path)
    disk.put(key(0), bytes(100))
    path = disk.path(key(0))
    path.write_bytes(path.read_bytes()[:-10])
    assert disk.get_many([key(0)]) == {}
    assert not path.exists()
    assert any("truncated" in r.getMessage() for r in caplog.records)
    disk.put(key(0), bytes(100))  # the re-prefilled block is written again
    assert disk.get_many([key(0)]) == {key(0): bytes(100)}
    assert disk.usage().misses == 1


def test_a_file_holding_another_blocks_bytes_is_a_miss(tmp_path):
    disk = DiskBlocks(tmp_path)
    disk.put(key(1), b"one")
    disk.path(key(2)).parent.mkdir(parents=True, exist_ok=True)
    os.replace(disk.path(key(1)), disk.path(key(2)))
    assert disk.get_many([key(2)]) == {}


def test_a_block_file_removed_by_another_process_is_a_miss_not_an_error(tmp_path):
    disk = DiskBlocks(tmp_path, max_bytes=10_000)
    disk.put(key(0), b"abc")
    disk.path(key(0)).unlink()
    assert disk.get_many([key(0)]) == {}
    assert disk.has_many([key(0)]) == set()
    assert disk.usage().blocks == 0


def test_two_disk_tiers_on_one_directory_see_each_others_blocks(tmp_path):
    first, second = DiskBlocks(tmp_path, max_bytes=10_000), DiskBlocks(tmp_path, max_bytes=10_000)
    first.usage()  # both indexes built before the writes
    second.usage()
    first.put(key(1), b"from first")
    second.put(key(2), b"from second")
    assert second.get_many([key(1)]) == {key(1): b"from first"}
    assert first.get_many([key(2)]) == {key(2): b"from second"}
    second.put(key(1), b"from first")  # already there: not written again
    assert second.usage().bytes_written == len(b"from second") + HEADER
    assert {block.key for block in first.listing()} == {key(1), key(2)}


def test_a_block_another_process_read_lately_is_not_evicted_first(tmp_path):
    size = 100 + HEADER
    mine, other = DiskBlocks(tmp_path, max_bytes=2 * size), DiskBlocks(tmp_path, max_bytes=2 * size)
    mine.put(key(0), bytes(100))
    mine.put(key(1), bytes(100))
    age(mine, key(0), 20)
    age(mine, key(1), 10)
    mine = DiskBlocks(tmp_path, max_bytes=2 * size)
    mine.usage()  # indexed: 0 oldest, then 1
    other.get_many([key(0)])  # another process reads 0: its mtime moves on
    mine.put(key(2), bytes(100))
    assert mine.has_many([key(0), key(1), key(2)]) == {key(0), key(2)}


@pytest.mark.parametrize("where", ["replace", "write"])
def test_a_full_disk_raises_block_tier_unavailable_and_leaves_no_temp_file(tmp_path, monkeypatch, where):
    disk = DiskBlocks(tmp_path)
    disk.put(key(0), b"kept")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    if where == "replace":
        monkeypatch.setattr(os, "replace", full)
    else:
        monkeypatch.setattr("agentkv.kvstore.block_files.open", _open_failing_writes(full), raising=False)
    with pytest.raises(BlockTierUnavailable, match="free space on the disk"):
        disk.put(key(1), b"lost")
    monkeypatch.undo()
    assert files_under(tmp_path) == [f"{key(0)}{BLOCK_SUFFIX}"]
    assert disk.get_many([key(0), key(1)]) == {key(0): b"kept"}


def _open_failing_writes(error):
    """``open`` whose files raise ``error`` on write (a disk that fills while the block is written)."""
    real_open = open

    def opener(*args, **kwargs):
        handle = real_open(*args, **kwargs)

        class Failing:
            def __enter__(self):
                return self

            def __exit__(self, *exc):
                handle.close()

            def write(self, data):
                error()

        return Failing()

    return opener


def test_a_directory_this_user_cannot_write_fails_check_with_what_to_fix(tmp_path, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr("agentkv.kvstore.block_files.tempfile.mkstemp", refused)
    with pytest.raises(BlockTierUnavailable, match="make .* writable by this user"):
        DiskBlocks(tmp_path).check()
    with pytest.raises(BlockTierUnavailable, match="writable"):
        DiskBlocks(tmp_path).put(key(0), b"x")


def test_check_creates_the_directory_and_leaves_nothing_behind(tmp_path):
    DiskBlocks(tmp_path / "a" / "b").check()
    assert (tmp_path / "a" / "b").is_dir() and files_under(tmp_path) == []


def test_the_disk_listing_lists_what_is_held_with_sizes_and_utc_mtimes(tmp_path):
    disk = DiskBlocks(tmp_path)
    disk.put(key(1), b"a")
    disk.put(key(300), b"bcd")
    (tmp_path / "00" / "notes.txt").write_text("not a block")
    (tmp_path / "00" / f"{'0' * 31}z{BLOCK_SUFFIX}").write_text("not a key")
    listed = sorted(disk.listing(), key=lambda block: block.key)
    assert [(b.key, b.nbytes) for b in listed] == [(key(1), 1 + HEADER), (key(300), 3 + HEADER)]
    assert all(b.modified.utcoffset().total_seconds() == 0 for b in listed)
    assert list(DiskBlocks(tmp_path / "none").listing()) == []


def test_a_temp_file_a_crash_left_an_hour_ago_is_removed_by_the_first_scan(tmp_path):
    disk = DiskBlocks(tmp_path)
    disk.put(key(0), b"x")
    stale = tmp_path / "00" / f".{key(1)}.abc.tmp"
    fresh = tmp_path / "00" / f".{key(2)}.abc.tmp"
    stale.write_bytes(b"partial")
    fresh.write_bytes(b"being written")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert [block.key for block in DiskBlocks(tmp_path).listing()] == [key(0)]
    assert not stale.exists() and fresh.exists()


@pytest.mark.parametrize("bad", ["../x", "A" * 32, "a" * 31])
def test_a_bad_key_is_a_user_error_and_never_becomes_a_path(tmp_path, bad):
    disk = DiskBlocks(tmp_path / "kv")
    for call in (lambda: disk.put(bad, b"x"), lambda: disk.get_many([bad]), lambda: disk.has_many([bad]),
                 lambda: disk.remove([bad]), lambda: disk.path(bad)):
        with pytest.raises(UserError, match="32 lowercase hex digits"):
            call()
    assert not (tmp_path / "kv").exists()


def test_the_disk_tier_follows_the_tier_protocol(tmp_path):
    tier: BlockTier = DiskBlocks(tmp_path)
    assert (tier.name, tier.persistent) == ("disk", True)
    with pytest.raises(UserError, match="max_bytes"):
        DiskBlocks(tmp_path, max_bytes=0)
