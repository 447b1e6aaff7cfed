"""KV snapshots as objects in an S3 bucket (AWS S3 or any S3-compatible server), through boto3.

The same ``SnapshotStorage`` as the snapshot directory, for processes on several machines that
share one database. Object keys (the row keeps the part after the prefix)::

    <prefix>/<tenant>/<fingerprint>/<conversation>/<tokens>-<unique>-<checksum>.safetensors

``tenant`` is "default" or ``t-`` + a hash of the tenant's salt (the salt itself is not
published); ``fingerprint`` the model + KV layout identity (readable part + hash); ``unique`` a
random part, so two saves of the same KV never share an object that one of them may delete.
Credentials, endpoint and region come from boto3's standard sources (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``, ``AWS_REGION``)::

    objects = SnapshotObjects("my-bucket", "agentkv/kv")
    name = objects.scoped("team-a").write("sess-1", snapshot)
    snapshot = objects.load(name, expected_fingerprint=fp, expected_checksum=snapshot.checksum())
"""

from __future__ import annotations

import hashlib
import re
import tempfile
import uuid
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta, timezone
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from agentkv.errors import AgentKVError, SnapshotCorrupt, SnapshotIncompatible, UserError
from agentkv.kv.snapshot import KVSnapshot

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

__all__ = ["OBJECT_SUFFIX", "SnapshotObjects", "SnapshotStoreUnavailable"]

OBJECT_SUFFIX = ".safetensors"
"""The end of every snapshot object's key (the content is the snapshot file format)."""
CONNECT_TIMEOUT_S = 3.0
READ_TIMEOUT_S = 30.0
MAX_ATTEMPTS = 2
"""Bounded: an endpoint that cannot be reached fails within seconds, not minutes."""
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_MISSING = {"404", "NoSuchKey", "NotFound"}
T = TypeVar("T")


class SnapshotStoreUnavailable(AgentKVError):
    """The snapshot bucket cannot be used: endpoint unreachable, credentials refused, no bucket."""


class SnapshotObjects:
    """Snapshots in ``bucket`` under ``prefix`` ("" for the bucket's root); no I/O until first use."""

    def __init__(self, bucket: str, prefix: str = "", *, tenant: str = "", client: S3Client | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.tenant = tenant
        """The tenant salt new snapshots are written under ("" : the default tenant)."""
        self.client: S3Client = client if client is not None else new_s3_client()
        """The boto3 S3 client (thread-safe; shared by ``scoped`` copies)."""

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``, for messages."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    # -- names --------------------------------------------------------------------------------

    def key(self, name: str) -> str:
        """The object key of a stored name (relative to the prefix) or of a resolved ``s3:/...`` path."""
        for scheme in ("s3://", "s3:/"):
            if name.startswith(scheme):
                bucket, _, key = name[len(scheme):].partition("/")
                if bucket != self.bucket:
                    raise SnapshotCorrupt(f"KV snapshot {name} is in bucket {bucket!r}, not this store's "
                                          f"{self.bucket!r}; delete its row, the conversation will re-prefill")
                return key
        return f"{self.prefix}/{name}" if self.prefix else name

    def resolve(self, name: str) -> Path:
        """``Path("s3:/bucket/key")`` (a path keeps one slash): shown in records and warnings."""
        return Path(f"s3://{self.bucket}/{self.key(name)}")

    def scoped(self, tenant: str) -> SnapshotObjects:
        """This bucket and prefix, writing under ``tenant``'s keys (same client)."""
        return SnapshotObjects(self.bucket, self.prefix, tenant=tenant, client=self.client)

    def object_name(self, conversation_id: str, snapshot: KVSnapshot) -> str:
        """A new name (key below the prefix) for ``snapshot`` of ``conversation_id`` under this tenant."""
        tenant = f"t-{_digest(self.tenant)[:16]}" if self.tenant else "default"
        checksum = snapshot.checksum().rpartition(":")[2][:32]
        leaf = f"{snapshot.num_tokens}-{uuid.uuid4().hex[:8]}-{checksum}{OBJECT_SUFFIX}"
        return "/".join((tenant, _segment(snapshot.fingerprint), _segment(conversation_id), leaf))

    # -- SnapshotStorage ------------------------------------------------------------------------

    def write(self, conversation_id: str, snapshot: KVSnapshot) -> str:
        """Upload ``snapshot`` as a new object (a PUT is atomic: readers see all of it or none)."""
        name = self.object_name(conversation_id, snapshot)
        with tempfile.TemporaryDirectory(prefix="agentkv-s3-") as tmp:
            path = Path(tmp) / "snapshot.safetensors"
            snapshot.to_file(path)
            self._call("upload", name, lambda: self.client.upload_file(
                str(path), self.bucket, self.key(name),
                ExtraArgs={"ContentType": "application/octet-stream",
                           "Metadata": {"agentkv-checksum": snapshot.checksum()}}))
        return name

    def load(self, name: str, *, expected_fingerprint: str, expected_checksum: str) -> KVSnapshot:
        """Download and verify one snapshot; ``SnapshotCorrupt`` for a missing, damaged or replaced
        object, ``SnapshotIncompatible`` for another model's (refused from its key, unread)."""
        key = self.key(name)
        where = f"s3://{self.bucket}/{key}"
        parts = key.removeprefix(f"{self.prefix}/" if self.prefix else "").split("/")
        if len(parts) == 4 and parts[1] != _segment(expected_fingerprint):
            raise SnapshotIncompatible(f"snapshot {where} was made for another model or KV layout "
                                       f"({parts[1]}), not {expected_fingerprint!r}; restore it with that "
                                       "model, or delete it and let the conversation re-prefill")
        with tempfile.TemporaryDirectory(prefix="agentkv-s3-") as tmp:
            path = Path(tmp) / "snapshot.safetensors"
            try:
                self._call("download", name, lambda: self.client.download_file(self.bucket, key, str(path)))
            except _Missing as e:
                raise SnapshotCorrupt(f"KV snapshot {where} is missing; delete its row, the conversation "
                                      "will re-prefill from its history") from e
            try:
                snapshot = KVSnapshot.from_file(path, expected_fingerprint=expected_fingerprint)
            except (SnapshotCorrupt, SnapshotIncompatible) as e:
                raise type(e)(str(e).replace(str(path), where)) from e
        if snapshot.checksum() != expected_checksum:
            raise SnapshotCorrupt(f"KV snapshot {where} is not the object its database row was saved with "
                                  "(checksum differs); delete the snapshot, the conversation will re-prefill")
        return snapshot

    def looks_whole(self, name: str, nbytes: int) -> bool:
        """False when the object is missing, shorter than ``nbytes``, or cannot be asked about."""
        try:
            size = self._size(name)
        except (AgentKVError, _Missing):
            return False
        return size is not None and size >= nbytes

    def remove(self, names: Iterable[str]) -> int:
        """Delete objects (already missing ones are fine); returns the bytes freed."""
        freed = 0
        for name in names:
            size = self._size(name)
            if size is None:
                continue
            self._call("delete", name, partial(self.client.delete_object, Bucket=self.bucket, Key=self.key(name)))
            freed += size
        return freed

    def unreferenced(self, referenced: set[str], *, older_than: timedelta) -> list[str]:
        """Snapshot objects under the prefix that no row names, last written over ``older_than`` ago."""
        known = {self.key(name) for name in referenced}
        cutoff = datetime.now(timezone.utc) - older_than
        root = f"{self.prefix}/" if self.prefix else ""
        found: list[str] = []

        def scan() -> None:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root):
                for item in page.get("Contents", []):
                    key = item["Key"]
                    if key.endswith(OBJECT_SUFFIX) and key not in known and item["LastModified"] < cutoff:
                        found.append(key[len(root):])

        self._call("list", root, scan)
        return found

    def check(self) -> None:
        """``SnapshotStoreUnavailable`` now if the bucket cannot be reached, read or does not exist."""
        try:
            self._call("check", "", lambda: self.client.head_bucket(Bucket=self.bucket))
        except _Missing as e:
            raise SnapshotStoreUnavailable(
                f"the snapshot bucket {self.bucket!r} does not exist at {self._endpoint()}; create it "
                "(e.g. `aws s3 mb s3://" + self.bucket + "`) or pass another --snapshots / AGENTKV_SNAPSHOT_URL") from e

    # -- internals --------------------------------------------------------------------------------

    def _size(self, name: str) -> int | None:
        """The object's size; None if it does not exist."""
        try:
            head = self._call("head", name, lambda: self.client.head_object(Bucket=self.bucket, Key=self.key(name)))
        except _Missing:
            return None
        return int(head["ContentLength"])

    def _endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)

    def _call(self, what: str, name: str, call: Callable[[], T]) -> T:
        """Run one S3 request: ``_Missing`` for a 404, ``SnapshotStoreUnavailable`` for the rest."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return call()
        except ClientError as e:
            code = str(e.response.get("Error", {}).get("Code", ""))
            if code in _MISSING and what != "list":
                raise _Missing(name) from e
            raise self._unavailable(what, f"{code or 'error'}: {e}") from e
        except (BotoCoreError, S3UploadFailedError) as e:
            raise self._unavailable(what, str(e)) from e

    def _unavailable(self, what: str, reason: str) -> SnapshotStoreUnavailable:
        hint = ("check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
                if any(word in reason for word in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                                                   "403", "credentials"))
                else "check that the server runs and AWS_ENDPOINT_URL_S3 / AWS_REGION point at it")
        return SnapshotStoreUnavailable(
            f"the snapshot store {self.url} at {self._endpoint()} failed ({what}): {reason}; {hint}, "
            "or pass another --snapshots / AGENTKV_SNAPSHOT_URL")


class _Missing(Exception):
    """An object (or bucket) that does not exist: a 404, which each caller turns into its own answer."""


def new_s3_client(*, max_pool_connections: int = 10) -> S3Client:
    """A boto3 S3 client with short timeouts and few retries, configured from the environment, with
    up to ``max_pool_connections`` connections (as many as the transfers run in parallel):
    ``client = new_s3_client(max_pool_connections=16)``."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError as e:
        raise UserError("S3 storage needs boto3: pip install 'agentkv[s3]' (or pip install boto3)") from e
    config = Config(connect_timeout=CONNECT_TIMEOUT_S, read_timeout=READ_TIMEOUT_S,
                    retries={"max_attempts": MAX_ATTEMPTS, "mode": "standard"},
                    max_pool_connections=max_pool_connections)
    # NOTE: a session of its own: boto3's default session caches the credentials it first found
    client: Any = boto3.session.Session().client("s3", config=config)
    return client  # type: ignore[no-any-return]


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _segment(text: str) -> str:
    """One key segment for any string: its readable characters, then a hash (no two strings share one)."""
    readable = _UNSAFE.sub("_", text)[:48].strip(".") or "x"
    return f"{readable}-{_digest(text)[:12]}"
