"""KV snapshots in an S3 bucket: round trips, verification on read, tenants, prune, URL selection.

The S3 tests run against a real server (``eval "$(bash scripts/start_s3.sh)"`` sets
``AGENTKV_TEST_S3_URL`` and the ``AWS_*`` variables; ``.ci/run`` does it) and skip without one. The
URL checks need no server."""

from __future__ import annotations

import logging
import os
import uuid
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from agentkv import Agent, Runtime
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store
from agentkv.memory.snapshots import ENV_SNAPSHOT_URL, SnapshotFiles, SnapshotURLError
from agentkv.testing import ScriptedEngine

S3_ENV = "AGENTKV_TEST_S3_URL"
AGENT = Agent(name="s3", instructions="You are a terse assistant.")


@pytest.fixture
def s3_url() -> str:
    """A fresh prefix in the test bucket, so tests never see each other's objects."""
    base = os.environ.get(S3_ENV)
    if not base:
        pytest.skip(f"no S3 server: set {S3_ENV} (eval \"$(bash scripts/start_s3.sh)\")")
    pytest.importorskip("boto3")
    return f"{base.rstrip('/')}/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def s3_client():
    import boto3

    return boto3.client("s3")


def make_snapshot(n_tokens: int, seed: int = 0, fingerprint: str = "model-a:kv=f32:CPU") -> KVSnapshot:
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, 1, 2, n_tokens, 8)).astype(np.float32)
    values = rng.standard_normal((2, 1, 2, n_tokens, 8)).astype(np.float32)
    return KVSnapshot.from_float(range(100, 100 + n_tokens), keys, values, precision="f32", fingerprint=fingerprint)


async def stored_session(store: Store, conversation_id: str = "conv-1") -> str:
    await store.upsert_agent("s3", None, [], {})
    return (await store.create_conversation("s3", conversation_id=conversation_id)).id


def bucket_and_key(record_path: Path) -> tuple[str, str]:
    text = str(record_path)
    assert text.startswith("s3:/")
    bucket, _, key = text[len("s3:/"):].partition("/")
    return bucket, key


async def test_a_snapshot_saved_to_s3_loads_back_bit_exact_under_a_tenant_model_session_key(tmp_path, s3_url):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url)
    sid = await stored_session(store)
    snapshot = make_snapshot(40)
    record = await store.save_snapshot(sid, snapshot)
    bucket, key = bucket_and_key(record.path)
    assert f"s3://{bucket}/{key}".startswith(s3_url + "/default/model-a_kv_f32_CPU-")
    assert "/conv-1-" in key and key.endswith(f"-{snapshot.checksum().partition(':')[2][:32]}.safetensors")
    loaded = await store.load_snapshot(record, expected_fingerprint=snapshot.fingerprint)
    assert loaded.tokens == snapshot.tokens and loaded.checksum() == snapshot.checksum()
    np.testing.assert_array_equal(loaded.keys, snapshot.keys)
    np.testing.assert_array_equal(loaded.values, snapshot.values)


async def test_a_conversation_resumed_in_a_new_runtime_restores_its_kv_from_s3(tmp_path, s3_url):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    first = Runtime(ScriptedEngine(["Blue, red, green."]), Store(url, snapshots=s3_url), agents=[AGENT])
    session = await first.open_conversation(AGENT, conversation_id="resume-me")
    await first.run(session, "Name three colours.")
    await first.aclose()
    store = Store(url, snapshots=s3_url)  # a new process would open the same two
    newest = (await store.snapshots("resume-me"))[0]
    assert str(newest.path).startswith("s3:/")
    resumed = await Runtime(ScriptedEngine([]), store, agents=[AGENT]).resume("resume-me")
    assert resumed.resume_report.restored_tokens == newest.num_tokens > 0
    assert resumed.resume_report.skipped_snapshots == ()


async def test_a_corrupted_object_is_skipped_with_a_warning_and_the_conversation_reprefills(
        tmp_path, s3_url, s3_client, caplog):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    first = Runtime(ScriptedEngine(["One."]), Store(url, snapshots=s3_url), agents=[AGENT])
    session = await first.open_conversation(AGENT, conversation_id="flipped")
    await first.run(session, "Say one word.")
    await first.aclose()
    store = Store(url, snapshots=s3_url)
    records = await store.snapshots("flipped")
    for record in records:  # flip the last byte of every snapshot of the conversation
        bucket, key = bucket_and_key(record.path)
        body = bytearray(s3_client.get_object(Bucket=bucket, Key=key)["Body"].read())
        body[-1] ^= 0xFF
        s3_client.put_object(Bucket=bucket, Key=key, Body=bytes(body))
    with pytest.raises(SnapshotCorrupt, match="s3://.*checksum"):
        await store.load_snapshot(records[0], expected_fingerprint=records[0].fingerprint)
    with caplog.at_level(logging.WARNING):
        resumed = await Runtime(ScriptedEngine([]), store, agents=[AGENT]).resume("flipped")
    assert resumed.resume_report.restored_tokens == 0
    assert len(resumed.resume_report.skipped_snapshots) == len(records) > 0
    assert any("skipping snapshot s3:/" in line for line in caplog.messages)


async def test_a_missing_object_is_corrupt_and_another_models_is_refused_unread(tmp_path, s3_url, s3_client):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url)
    sid = await stored_session(store)
    kept, gone = await store.save_snapshot(sid, make_snapshot(8)), await store.save_snapshot(sid, make_snapshot(9))
    with pytest.raises(SnapshotIncompatible, match="another model"):
        store.files.load(str(kept.path), expected_fingerprint="model-b:kv=f32:CPU", expected_checksum=kept.checksum)
    with pytest.raises(SnapshotIncompatible):
        await store.load_snapshot(kept, expected_fingerprint="model-b:kv=f32:CPU")
    s3_client.delete_object(Bucket=bucket_and_key(gone.path)[0], Key=bucket_and_key(gone.path)[1])
    assert not store.files.looks_whole(str(gone.path), gone.nbytes)
    assert store.files.looks_whole(str(kept.path), kept.nbytes)
    with pytest.raises(SnapshotCorrupt, match="missing"):
        await store.load_snapshot(gone, expected_fingerprint=gone.fingerprint)


async def test_prune_removes_surplus_and_unreferenced_objects_and_keeps_the_referenced(tmp_path, s3_url, s3_client):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url, keep_snapshots=3)
    sid = await stored_session(store)
    records = [await store.save_snapshot(sid, make_snapshot(n, seed=n)) for n in (4, 5, 6)]
    orphan = store.files.write(sid, make_snapshot(7))  # a save that crashed before its row
    bucket, _ = bucket_and_key(records[0].path)
    root = s3_url.removeprefix(f"s3://{bucket}/") + "/"

    def keys() -> set[str]:
        listed = s3_client.list_objects_v2(Bucket=bucket, Prefix=root).get("Contents", [])
        return {item["Key"] for item in listed}

    assert len(keys()) == 4
    fresh = await store.prune(keep_snapshots=1)  # the orphan is younger than the grace period: kept
    assert keys() == {bucket_and_key(records[-1].path)[1], root + orphan}
    # NOTE: the server stamps LastModified in whole seconds: a grace below zero makes "now" old enough
    report = await store.prune(orphans_older_than=timedelta(seconds=-5))
    assert keys() == {bucket_and_key(records[-1].path)[1]}
    assert (fresh.snapshots, report.orphan_files) == (2, 1) and report.bytes_freed > 0


async def test_tenants_write_to_keys_that_never_collide_and_never_show_the_salt(tmp_path, s3_url):
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url)
    sid = await stored_session(store)
    snapshot = make_snapshot(6)
    default, a, b = [await store.save_snapshot(sid, snapshot, tenant=t, keep=3) for t in ("", "salt-a", "salt-b")]
    tenants = [bucket_and_key(r.path)[1].removeprefix(s3_url.split("/", 3)[3] + "/").split("/")[0]
               for r in (default, a, b)]
    assert tenants[0] == "default" and len(set(tenants)) == 3
    assert not any("salt" in t for t in tenants)
    for record in (default, a, b):
        assert (await store.load_snapshot(record, expected_fingerprint=snapshot.fingerprint)).tokens == snapshot.tokens


async def test_a_missing_bucket_or_an_unreachable_endpoint_is_a_clear_error_at_first_use(tmp_path, s3_url, monkeypatch):
    from agentkv.memory.snapshot_objects import SnapshotStoreUnavailable

    missing = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/kv")
    with pytest.raises(SnapshotStoreUnavailable, match="does not exist"):
        missing.files.check()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")  # the discard port: nothing listens
    down = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url)  # constructing does no I/O
    with pytest.raises(SnapshotStoreUnavailable, match="127.0.0.1:9.*AWS_ENDPOINT_URL_S3"):
        down.files.check()
    sid = await stored_session(down)
    with pytest.raises(SnapshotStoreUnavailable):
        await down.save_snapshot(sid, make_snapshot(3))
    assert await down.snapshots(sid) == []  # no row for a snapshot that was never stored


async def test_refused_credentials_are_a_clear_error_naming_the_variables(tmp_path, s3_url, monkeypatch):
    from agentkv.memory.snapshot_objects import SnapshotStoreUnavailable

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=s3_url)
    sid = await stored_session(store)
    with pytest.raises(SnapshotStoreUnavailable, match="AWS_SECRET_ACCESS_KEY"):
        await store.save_snapshot(sid, make_snapshot(3))


@pytest.mark.parametrize("location", ["gs://bucket/kv", "s3://", "s3:///kv", "file://otherhost/kv", "ftp://h/x"])
def test_an_unsupported_snapshot_location_is_a_user_error_saying_what_to_pass(tmp_path, location):
    with pytest.raises(SnapshotURLError, match="s3://<bucket>|file:///") as raised:
        Store(f"sqlite:///{tmp_path / 'a.db'}", snapshots=location)
    assert isinstance(raised.value, UserError)


def test_file_urls_paths_and_the_environment_choose_a_snapshot_directory(tmp_path, monkeypatch):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    chosen = Store(db, snapshots=f"file://{tmp_path / 'kv'}").files
    assert isinstance(chosen, SnapshotFiles) and chosen.directory == tmp_path / "kv"
    plain = Store(db, snapshots=str(tmp_path / "plain")).files
    assert isinstance(plain, SnapshotFiles) and plain.directory == tmp_path / "plain"
    default = Store(db).files
    assert isinstance(default, SnapshotFiles) and default.directory == tmp_path / "snapshots"
    monkeypatch.setenv("AGENTKV_DB_URL", db)
    monkeypatch.setenv(ENV_SNAPSHOT_URL, str(tmp_path / "from-env"))
    from_env = Store.from_env().files
    assert isinstance(from_env, SnapshotFiles) and from_env.directory == tmp_path / "from-env"
    with pytest.raises(UserError, match="not both"):
        Store(db, snapshots="s3://b/kv", snapshot_dir=tmp_path)


def test_serve_with_an_unreachable_snapshot_endpoint_fails_before_the_model_loads(tmp_path, monkeypatch):
    pytest.importorskip("boto3")
    from agentkv.cli.agent import AgentOptions
    from agentkv.cli.serve import ServeOptions, serve
    from agentkv.memory.snapshot_objects import SnapshotStoreUnavailable

    monkeypatch.setattr("agentkv.engine.factory.open_engine", lambda *a, **k: pytest.fail("model loaded"))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    options = ServeOptions("127.0.0.1", 8000, None, f"sqlite:///{tmp_path / 'a.db'}", None, None, 4, 4, True,
                           AgentOptions(), snapshots="s3://bucket/kv")
    with pytest.raises(SnapshotStoreUnavailable, match="--snapshots"):
        serve(options)
    monkeypatch.setenv(ENV_SNAPSHOT_URL, "gs://bucket/kv")  # the environment, when --snapshots is not given
    with pytest.raises(SnapshotURLError):
        serve(ServeOptions("127.0.0.1", 8000, None, f"sqlite:///{tmp_path / 'a.db'}", None, None, 4, 4, True,
                           AgentOptions()))
