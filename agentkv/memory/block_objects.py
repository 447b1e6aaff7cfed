"""L4 of the KV store: blocks as objects in an S3 bucket (AWS S3 or any S3-compatible server).

One object per block at ``<prefix>/blocks/<key[:2]>/<key>`` (keys carry the tenant salt and the
model, ``kv/block_keys.py``: no tenant or model folder is needed, and tenants never share a key).
Writes go through boto3's transfer manager (``create_transfer_manager`` with ``max_concurrency``
threads); ``get_many`` of a run of blocks sends one GET per block from as many threads (the manager
would send a HEAD before each); the client has the bounded connect/read timeouts and attempts of
the snapshot bucket
(``snapshot_objects.py``), and credentials, endpoint and region come from boto3's standard sources::

    objects = ObjectBlocks("my-bucket", "agentkv/kv")
    objects.put(key, data)                   # BlockTierUnavailable if the bucket cannot be written
    objects.get_many(chain.keys)             # {key: data}; an unreachable bucket gives {} and a warning

The tier has no byte bound: garbage collection from SQL removes what nothing references
(``listing`` + ``remove``). A missing object is a miss; an unreachable endpoint or refused
credentials make ``put`` and ``check`` raise ``BlockTierUnavailable``, while ``get_many`` and
``has_many`` answer "absent" with one warning a minute (the turn then prefills: never a failed turn).
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from agentkv.errors import UserError
from agentkv.kvstore.block_tiers import (
    BlockTierUnavailable,
    StoredBlock,
    TierCounters,
    TierUsage,
    WarningLimiter,
    check_data,
    check_key,
    is_key,
)
from agentkv.memory.snapshot_objects import MAX_ATTEMPTS, new_s3_client

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from s3transfer.manager import TransferManager

__all__ = ["ObjectBlocks"]

log = logging.getLogger(__name__)

_MISSING = {"404", "NoSuchKey", "NotFound"}
_DELETE_BATCH = 1000  # S3's most keys per DeleteObjects
T = TypeVar("T")


class ObjectBlocks:
    """Blocks in ``bucket`` under ``prefix`` ("" for the bucket's root); no I/O until first use.
    See the module docstring for a call. ``close()`` (or ``with``) stops its transfer threads."""

    name = "s3"
    persistent = True

    def __init__(self, bucket: str, prefix: str = "", *, client: S3Client | None = None,
                 max_concurrency: int = 16) -> None:
        if not isinstance(bucket, str) or not bucket.strip():
            raise UserError(f"bucket must be a bucket name (e.g. 'my-bucket'), got {bucket!r}")
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency <= 0:
            raise UserError(f"max_concurrency must be a positive int (parallel S3 requests, e.g. 16), "
                            f"got {max_concurrency!r}")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.max_concurrency = max_concurrency
        self.client: S3Client = (client if client is not None
                                 else new_s3_client(max_pool_connections=max(10, max_concurrency)))
        """The boto3 S3 client (thread-safe)."""
        self._counters = TierCounters()
        self._limiter = WarningLimiter(60.0)
        self._lock = threading.Lock()
        self._manager: TransferManager | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def url(self) -> str:
        """``s3://bucket/prefix``, for messages."""
        return f"s3://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, key: str) -> str:
        """The object key of block ``key``: ``<prefix>/blocks/<key[:2]>/<key>``."""
        key = check_key(key)
        return f"{self._root()}{key[:2]}/{key}"

    # -- BlockTier --------------------------------------------------------------------------------

    def get_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """Download the blocks held among ``keys`` in parallel (one GET each); missing ones are
        absent, and so is every block when the bucket cannot be read (one warning a minute)."""
        wanted = list(dict.fromkeys(self.key(key) for key in keys))
        if not wanted:
            return {}
        # NOTE: plain GETs, not the transfer manager's downloads: each of those sends a HEAD first
        # (for the size it splits large objects by), doubling the requests of blocks far below its
        # multipart threshold — 761 ms against 419 ms for a 2,400-token restore (128-token blocks, avx2)
        futures = {name: self._requests().submit(self._get, name) for name in wanted}
        found: dict[str, bytes] = {}
        for name, future in futures.items():
            try:
                found[name.rpartition("/")[2]] = future.result()
            except BlockTierUnavailable as e:  # a 404 is a plain miss; anything else a miss with a warning
                if not _is_missing(e.__cause__):
                    self._limiter.warn(log, "read", "reading KV blocks from %s failed (%s); they are prefilled "
                                       "instead", self.url, e)
        self._counters.read(hits=len(found), misses=len(wanted) - len(found),
                            nbytes=sum(len(data) for data in found.values()))
        return found

    def _get(self, name: str) -> bytes:
        """One object's bytes (``BlockTierUnavailable`` caused by the boto3 error, a 404 included)."""
        return self._call("read", lambda: self.client.get_object(Bucket=self.bucket, Key=name)["Body"].read())

    def has_many(self, keys: Sequence[str]) -> set[str]:
        """The keys among ``keys`` with an object (HEAD requests in parallel); none when the bucket
        cannot be read (one warning a minute)."""
        wanted = list(dict.fromkeys(check_key(key) for key in keys))
        sizes = self._sizes(wanted, quiet=True)
        return {key for key, size in sizes.items() if size is not None}

    def put(self, key: str, data: bytes) -> None:
        """Upload the block (a PUT is atomic: readers see all of it or none; the same key is the same
        content, so writing it again is harmless). ``BlockTierUnavailable`` if it cannot be written."""
        name = self.key(key)
        data = check_data(key, data)
        future = self._transfers().upload(io.BytesIO(data), self.bucket, name,
                                          extra_args={"ContentType": "application/octet-stream"})
        self._call("upload", future.result)
        self._counters.wrote(len(data))

    def remove(self, keys: Iterable[str]) -> int:
        """Delete these blocks' objects (missing ones are fine); the bytes freed.
        ``BlockTierUnavailable`` if the bucket cannot be reached."""
        sizes = self._sizes(list(dict.fromkeys(check_key(key) for key in keys)), quiet=False)
        present = [key for key, size in sizes.items() if size is not None]
        for start in range(0, len(present), _DELETE_BATCH):
            batch = [{"Key": self.key(key)} for key in present[start:start + _DELETE_BATCH]]
            answer = self._call("delete", lambda: self.client.delete_objects(
                Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}))  # type: ignore[typeddict-item]
            if answer.get("Errors"):
                first = answer["Errors"][0]
                raise self._unavailable("delete", f"{first.get('Code')}: {first.get('Message')} ({first.get('Key')})")
        return sum(size or 0 for size in sizes.values())

    def listing(self) -> Iterator[StoredBlock]:
        """Every block object under the prefix (pages of 1,000 keys, fetched as iterated)."""
        root = self._root()
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=root)
        iterator = iter(pages)
        while True:
            page = self._call("list", lambda: next(iterator, None))
            if page is None:
                return
            for item in page.get("Contents", []):
                shard, _, key = item["Key"][len(root):].partition("/")
                if is_key(key) and shard == key[:2]:
                    yield StoredBlock(key, int(item["Size"]), item["LastModified"])

    def usage(self) -> TierUsage:
        """The counters; blocks and bytes held are -1 (unknown without a listing), no bound."""
        return self._counters.usage(self.name, blocks=-1, nbytes=-1, max_bytes=None)

    def check(self) -> None:
        """``BlockTierUnavailable`` now if the bucket cannot be reached, read or does not exist."""
        try:
            self._call("check", lambda: self.client.head_bucket(Bucket=self.bucket))
        except BlockTierUnavailable as e:
            if not _is_missing(e.__cause__):
                raise
            raise BlockTierUnavailable(
                f"the KV block bucket {self.bucket!r} does not exist at {self._endpoint()}; create it "
                f"(e.g. `aws s3 mb s3://{self.bucket}`) or point the object tier at another bucket") from e

    def close(self) -> None:
        """Stop the transfer and request threads (idempotent); a later call starts new ones."""
        with self._lock:
            manager, requests, self._manager, self._pool = self._manager, self._pool, None, None
        if manager is not None:
            manager.shutdown()
        if requests is not None:
            requests.shutdown(wait=True)

    def __enter__(self) -> ObjectBlocks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------

    def _root(self) -> str:
        return f"{self.prefix}/blocks/" if self.prefix else "blocks/"

    def _transfers(self) -> TransferManager:
        """boto3's transfer manager for this client (made on first use)."""
        with self._lock:
            if self._manager is None:
                from boto3.s3.transfer import TransferConfig, create_transfer_manager

                config = TransferConfig(max_concurrency=self.max_concurrency, num_download_attempts=MAX_ATTEMPTS,
                                        preferred_transfer_client="classic")
                self._manager = create_transfer_manager(self.client, config)
            return self._manager

    def _requests(self) -> ThreadPoolExecutor:
        """The threads that send GET and HEAD requests in parallel (made on first use)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="agentkv-s3")
            return self._pool

    def _sizes(self, keys: list[str], *, quiet: bool) -> dict[str, int | None]:
        """Each key's object size (None: no object), from HEAD requests in parallel. ``quiet``: an
        unreachable bucket gives None for all, with one warning a minute; otherwise ``BlockTierUnavailable``."""
        futures = {key: self._requests().submit(self._size, key) for key in keys}
        sizes: dict[str, int | None] = {}
        for key, future in futures.items():
            try:
                sizes[key] = future.result()
            except BlockTierUnavailable as e:
                if not quiet:
                    raise
                self._limiter.warn(log, "read", "asking %s for KV blocks failed (%s); they are prefilled instead",
                                   self.url, e)
                sizes[key] = None
        return sizes

    def _size(self, key: str) -> int | None:
        try:
            head = self._call("head", lambda: self.client.head_object(Bucket=self.bucket, Key=self.key(key)))
        except BlockTierUnavailable as e:
            if _is_missing(e.__cause__):
                return None
            raise
        return int(head["ContentLength"])

    def _call(self, what: str, call: Callable[[], T]) -> T:
        """Run one S3 request or transfer: ``BlockTierUnavailable`` (caused by the boto3 error) if it fails."""
        from boto3.exceptions import S3UploadFailedError
        from botocore.exceptions import BotoCoreError, ClientError
        from s3transfer.exceptions import RetriesExceededError, TransferNotDoneError

        try:
            return call()
        except (ClientError, BotoCoreError, S3UploadFailedError, RetriesExceededError, TransferNotDoneError) as e:
            raise self._unavailable(what, _reason(e)) from e

    def _unavailable(self, what: str, reason: str) -> BlockTierUnavailable:
        return BlockTierUnavailable(f"the KV block store {self.url} at {self._endpoint()} failed ({what}): "
                                    f"{reason}; {self._hint(reason)}")

    def _hint(self, reason: str) -> str:
        if any(word in reason for word in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403",
                                           "credentials")):
            return "check the credentials (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)"
        return "check that the server runs and AWS_ENDPOINT_URL_S3 / AWS_REGION point at it"

    def _endpoint(self) -> str:
        return str(self.client.meta.endpoint_url)


def _is_missing(error: BaseException | None) -> bool:
    """True for S3's "no such object / bucket" (a 404)."""
    response: Any = getattr(error, "response", None)
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    return code in _MISSING


def _reason(error: BaseException) -> str:
    response: Any = getattr(error, "response", None)
    code = str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""
    return f"{code}: {error}" if code and code not in str(error) else str(error)

