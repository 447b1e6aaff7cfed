"""The object-store tier against a real S3 server: round trips, parallel reads, missing blocks,
listing and removal; and an endpoint that cannot be reached (no server needed for that).

The S3 tests run against a real server (``eval "$(bash scripts/start_s3.sh)"`` sets
``AGENTKV_TEST_S3_URL`` and the ``AWS_*`` variables; ``.ci/run`` does it) and skip without one."""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid

import pytest

from agentkv.errors import UserError
from agentkv.memory.block_objects import ObjectBlocks
from agentkv.kvstore.block_tiers import BlockTier, BlockTierUnavailable

S3_ENV = "AGENTKV_TEST_S3_URL"


def key(n: int) -> str:
    return f"{n:032x}"


@pytest.fixture
def objects():
    """An ObjectBlocks on a fresh prefix of the test bucket, emptied afterwards."""
    base = os.environ.get(S3_ENV)
    if not base:
        pytest.skip(f"no S3 server: set {S3_ENV} (eval \"$(bash scripts/start_s3.sh)\")")
    pytest.importorskip("boto3")
    bucket, _, prefix = base.removeprefix("s3://").partition("/")
    tier = ObjectBlocks(bucket, f"{prefix.strip('/')}/{uuid.uuid4().hex[:12]}")
    yield tier
    for page in tier.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=tier.prefix + "/"):
        for item in page.get("Contents", []):
            tier.client.delete_object(Bucket=bucket, Key=item["Key"])
    tier.close()


@pytest.fixture
def unreachable(monkeypatch):
    """An ObjectBlocks whose endpoint is a closed port on this machine (credentials set, any server or none)."""
    pytest.importorskip("boto3")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "agentkv")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "agentkv-secret")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    tier = ObjectBlocks("agentkv-nowhere", "kv")
    yield tier
    tier.close()


def test_a_block_put_in_the_bucket_comes_back_under_prefix_blocks_shard_key(objects):
    objects.put(key(1), b"one")
    objects.put(key(2), b"two!")
    assert objects.key(key(1)) == f"{objects.prefix}/blocks/00/{key(1)}"
    head = objects.client.head_object(Bucket=objects.bucket, Key=objects.key(key(1)))
    assert head["ContentLength"] == 3
    assert objects.get_many([key(1), key(2)]) == {key(1): b"one", key(2): b"two!"}
    assert objects.has_many([key(1), key(3)]) == {key(1)}


def test_sixty_four_blocks_come_back_in_one_get_many_downloaded_on_several_threads(objects):
    blocks = {key(n): os.urandom(4096 + n) for n in range(64)}
    for k, data in blocks.items():
        objects.put(k, data)
    threads: set[int] = set()
    calls: list[str] = []
    objects.client.meta.events.register("before-call.s3.GetObject",
                                        lambda **kwargs: threads.add(threading.get_ident()))
    objects.client.meta.events.register("before-call.s3", lambda model, **kwargs: calls.append(model.name))
    assert objects.get_many(list(blocks)) == blocks
    assert len(threads) > 1
    assert calls == ["GetObject"] * 64  # one request a block: no HEAD before each GET


def test_missing_blocks_are_absent_and_counted_as_misses_without_a_warning(objects, caplog):
    objects.put(key(1), b"one")
    with caplog.at_level(logging.WARNING, logger="agentkv.memory.block_objects"):
        assert objects.get_many([key(1), key(2), key(3)]) == {key(1): b"one"}
        assert objects.has_many([key(2)]) == set()
    assert caplog.records == []
    usage = objects.usage()
    assert (usage.hits, usage.misses, usage.bytes_read, usage.bytes_written) == (1, 2, 3, 3)
    assert (usage.tier, usage.blocks, usage.nbytes, usage.max_bytes) == ("s3", -1, -1, None)


def test_the_listing_names_every_block_and_remove_frees_their_bytes(objects):
    for n in range(5):
        objects.put(key(n), bytes(10 + n))
    objects.client.put_object(Bucket=objects.bucket, Key=f"{objects.prefix}/blocks/00/not-a-block", Body=b"x")
    listed = sorted(objects.listing(), key=lambda block: block.key)
    assert [(b.key, b.nbytes) for b in listed] == [(key(n), 10 + n) for n in range(5)]
    assert all(b.modified.utcoffset().total_seconds() == 0 for b in listed)
    assert objects.remove([key(0), key(1), key(99)]) == 10 + 11
    assert {b.key for b in objects.listing()} == {key(2), key(3), key(4)}
    assert objects.remove([]) == 0


def test_check_passes_on_the_test_bucket_and_names_a_bucket_that_does_not_exist(objects):
    objects.check()
    missing = ObjectBlocks(f"agentkv-missing-{uuid.uuid4().hex[:8]}", client=objects.client)
    with pytest.raises(BlockTierUnavailable, match="does not exist"):
        missing.check()


def test_an_unreachable_endpoint_makes_put_and_check_raise_what_to_fix(unreachable):
    for call in (lambda: unreachable.put(key(1), b"x"), unreachable.check):
        with pytest.raises(BlockTierUnavailable, match="check that the server runs and AWS_ENDPOINT_URL_S3"):
            call()
    with pytest.raises(BlockTierUnavailable):
        unreachable.remove([key(1)])
    with pytest.raises(BlockTierUnavailable):
        list(unreachable.listing())


def test_an_unreachable_endpoint_reads_as_absent_blocks_with_one_warning(unreachable, caplog):
    with caplog.at_level(logging.WARNING, logger="agentkv.memory.block_objects"):
        assert unreachable.get_many([key(n) for n in range(8)]) == {}
        assert unreachable.has_many([key(n) for n in range(8)]) == set()
        assert unreachable.get_many([key(1)]) == {}
    assert len(caplog.records) == 1 and "prefilled instead" in caplog.records[0].getMessage()
    assert unreachable.usage().misses == 9


def test_a_bad_key_is_a_user_error_before_any_request(unreachable):
    for bad in ("../x", "A" * 32, "a" * 31):
        for call in (lambda: unreachable.put(bad, b"x"), lambda: unreachable.get_many([bad]),
                     lambda: unreachable.has_many([bad]), lambda: unreachable.remove([bad])):
            with pytest.raises(UserError, match="32 lowercase hex digits"):
                call()


def test_the_object_tier_follows_the_tier_protocol_and_refuses_bad_settings(unreachable):
    tier: BlockTier = unreachable
    assert (tier.name, tier.persistent) == ("s3", True)
    with pytest.raises(UserError, match="max_concurrency"):
        ObjectBlocks("b", max_concurrency=0, client=unreachable.client)
    with pytest.raises(UserError, match="bucket"):
        ObjectBlocks("", client=unreachable.client)
    assert ObjectBlocks("b", client=unreachable.client).key(key(7)) == f"blocks/00/{key(7)}"


def test_refused_credentials_make_put_and_check_name_the_credentials_and_reads_come_back_empty(objects, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    refused = ObjectBlocks(objects.bucket, objects.prefix)
    try:
        for call in (lambda: refused.put(key(1), b"x"), refused.check):
            with pytest.raises(BlockTierUnavailable, match="check the credentials"):
                call()
        assert refused.get_many([key(1)]) == {} and refused.has_many([key(1)]) == set()
    finally:
        refused.close()
    assert list(objects.listing()) == []
