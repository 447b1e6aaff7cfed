"""KV snapshot files beside the database: naming, atomic writes, verified loads, removal.

The database keeps each file's name (relative to the snapshot directory) and checksum::

    files = SnapshotFiles(Path("~/.local/share/agentkv/snapshots").expanduser())
    name = files.write("sess-1", snapshot)
    snapshot = files.load(name, expected_fingerprint=fp, expected_checksum=snapshot.checksum())
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path

from agentkv.kv.snapshot import SUFFIX, KVSnapshot
from agentkv.errors import SnapshotCorrupt, SnapshotIncompatible

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


class SnapshotFiles:
    """The directory of snapshot files; created on the first write."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory).expanduser()

    def resolve(self, name: str) -> Path:
        """The absolute path of a stored file name."""
        path = Path(name)
        return path if path.is_absolute() else self.directory / path

    def write(self, session_id: str, snapshot: KVSnapshot) -> str:
        """Write ``snapshot`` to a new file (temp + rename) and return its stored name."""
        self.directory.mkdir(parents=True, exist_ok=True)
        slug = _UNSAFE.sub("_", session_id)[:40] or "session"
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
                "differs); delete the snapshot, the session will re-prefill from its history"
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
            "model and KV precision, or delete it and let the session re-prefill"
        )
