"""Where KV snapshots are kept: the ``SnapshotStorage`` protocol, its file form, and URL selection.

The database keeps each snapshot's name (relative to the storage's root) and checksum; the
storage keeps the bytes. ``SnapshotFiles`` (a directory beside the database) is the embedded
default, ``agentkv.memory.snapshot_objects.SnapshotObjects`` an S3 bucket::

    files = SnapshotFiles(Path("~/.local/share/agentkv/snapshots").expanduser())
    name = files.write("sess-1", snapshot)
    snapshot = files.load(name, expected_fingerprint=fp, expected_checksum=snapshot.checksum())
    storage = open_snapshot_storage("s3://bucket/kv", default_dir=Path("/srv/kv"))
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Protocol
from urllib.parse import unquote, urlsplit

from agentkv.kv.snapshot import SUFFIX, KVSnapshot
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible, UserError

ENV_SNAPSHOT_URL = "AGENTKV_SNAPSHOT_URL"
"""Environment variable read by ``Store.from_env`` and the CLI: where snapshots go (a URL)."""

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class SnapshotURLError(UserError):
    """A snapshot location that is not ``s3://bucket[/prefix]``, ``file:///dir`` or a directory path."""


class SnapshotStorage(Protocol):
    """Where snapshot bytes live; every method blocks (the store calls them from worker threads).

    Names are what the database rows keep; ``resolve`` turns one into the ``SnapshotRecord.path``
    shown to users, and every method takes either form.
    """

    def resolve(self, name: str) -> Path:
        """The displayed location of a stored name (does no I/O): ``storage.resolve(row.path)``."""
        ...

    def scoped(self, tenant: str) -> SnapshotStorage:
        """This storage writing under tenant ``tenant`` (a tenant's salt; "" is the default
        tenant): ``storage.scoped("team-a").write(sid, snap)``. Reads and removals are by name."""
        ...

    def write(self, conversation_id: str, snapshot: KVSnapshot) -> str:
        """Store ``snapshot`` whole under a new name and return the name (a reader never sees
        half of it): ``name = storage.write("sess-1", snap)``."""
        ...

    def load(self, name: str, *, expected_fingerprint: str, expected_checksum: str) -> KVSnapshot:
        """Read and verify one snapshot: ``SnapshotCorrupt`` (missing, damaged, not the one the
        row was saved with) or ``SnapshotIncompatible`` (another model / KV layout)."""
        ...

    def looks_whole(self, name: str, nbytes: int) -> bool:
        """False when the snapshot is known damaged without reading it (missing, or shorter than
        the ``nbytes`` of arrays its row says it holds)."""
        ...

    def remove(self, names: Iterable[str]) -> int:
        """Delete snapshots (missing ones are fine); returns the bytes freed."""
        ...

    def unreferenced(self, referenced: set[str], *, older_than: timedelta) -> list[str]:
        """Stored snapshots no name in ``referenced`` points to, written more than ``older_than`` ago."""
        ...

    def check(self) -> None:
        """Fail now, with a named error saying what to fix, if snapshots cannot be stored here."""
        ...


def open_snapshot_storage(location: str | Path | None, *, default_dir: Path) -> SnapshotStorage:
    """The storage at ``location``: ``s3://bucket/prefix`` (``SnapshotObjects``; credentials and
    endpoint from the standard AWS environment), ``file:///dir`` or a directory path
    (``SnapshotFiles``), None for ``default_dir``. ``SnapshotURLError`` for anything else::

        storage = open_snapshot_storage(os.environ.get(ENV_SNAPSHOT_URL), default_dir=Path("kv"))
    """
    if location is None or isinstance(location, Path):
        return SnapshotFiles(location or default_dir)
    text = location.strip()
    if not text:
        return SnapshotFiles(default_dir)
    parts = urlsplit(text)
    if parts.scheme == "s3":
        from agentkv.memory.snapshot_objects import SnapshotObjects

        if not parts.netloc or parts.query or parts.fragment:
            raise SnapshotURLError(f"snapshot URL {text!r} names no bucket; pass s3://<bucket>[/<prefix>], "
                                   "e.g. s3://agentkv/snapshots")
        return SnapshotObjects(parts.netloc, parts.path.strip("/"))
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise SnapshotURLError(f"snapshot URL {text!r} is not a local directory; pass file:///<absolute dir>")
        return SnapshotFiles(Path(unquote(parts.path)))
    if parts.scheme == "" or (len(parts.scheme) == 1 and text[1:3] in (":\\", ":/")):  # a path (or C:\...)
        return SnapshotFiles(Path(text))
    raise SnapshotURLError(f"snapshot location {text!r} has an unsupported scheme {parts.scheme!r}; pass "
                           "s3://<bucket>[/<prefix>] (S3 or an S3-compatible server: set AWS_ENDPOINT_URL_S3), "
                           "file:///<dir> or a directory path")


class SnapshotFiles:
    """The directory of snapshot files; created on the first write."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).expanduser()

    def resolve(self, name: str) -> Path:
        """The absolute path of a stored file name."""
        path = Path(name)
        return path if path.is_absolute() else self.directory / path

    def scoped(self, tenant: str) -> SnapshotFiles:
        """The same directory: file names carry no tenant (one machine's files are one owner's)."""
        return self

    def check(self) -> None:
        """Nothing to check before the first write (which creates the directory)."""

    def write(self, conversation_id: str, snapshot: KVSnapshot) -> str:
        """Write ``snapshot`` to a new file (temp + rename) and return its stored name."""
        self.directory.mkdir(parents=True, exist_ok=True)
        slug = _UNSAFE.sub("_", conversation_id)[:40] or "conversation"
        name = f"{slug}-{snapshot.num_tokens}-{uuid.uuid4().hex[:12]}{SUFFIX}"
        snapshot.to_file(self.directory / name)
        return name

    def load(self, name: str, *, expected_fingerprint: str, expected_checksum: str) -> KVSnapshot:
        """Read a snapshot and check it is the one the database row describes.

        Raises ``SnapshotCorrupt`` (missing, damaged, or not the file the row was written
        with) or ``SnapshotIncompatible`` (another model / KV layout).
        """
        path = self.resolve(name)
        snapshot = KVSnapshot.from_file(path, expected_fingerprint=expected_fingerprint)
        if snapshot.checksum() != expected_checksum:
            raise SnapshotCorrupt(
                f"KV snapshot {path} is not the file its database row was saved with (checksum "
                "differs); delete the snapshot, the conversation will re-prefill from its history"
            )
        return snapshot

    def looks_whole(self, name: str, nbytes: int) -> bool:
        """False when the file is known to be damaged without reading it: missing, or smaller
        than the ``nbytes`` of arrays its row says it holds (cut short, e.g. by a full disk)."""
        try:
            return self.resolve(name).stat().st_size >= nbytes
        except OSError:
            return False

    def remove(self, names: Iterable[str]) -> int:
        """Delete files (already missing ones are fine); returns the bytes freed."""
        freed = 0
        for name in names:
            path = self.resolve(name)
            try:
                freed += path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                continue
        return freed

    def unreferenced(self, referenced: set[str], *, older_than: timedelta) -> list[str]:
        """Snapshot files in the directory that no name in ``referenced`` points to and that
        were last written more than ``older_than`` ago."""
        if not self.directory.is_dir():
            return []
        known = {str(self.resolve(name)) for name in referenced}
        cutoff = time.time() - older_than.total_seconds()
        return [path.name for path in self.directory.glob(f"*{SUFFIX}")
                if str(path) not in known and path.stat().st_mtime < cutoff]


def refuse_other_fingerprint(path: Path, found: str, expected: str) -> None:
    """Raise ``SnapshotIncompatible`` unless ``found == expected`` (checked before reading a file)."""
    if found != expected:
        raise SnapshotIncompatible(
            f"snapshot {path} was made for {found!r}, not {expected!r}; restore it with that "
            "model and KV precision, or delete it and let the conversation re-prefill"
        )
