"""Which tiers a store keeps its KV blocks in: host memory, a local disk, and where snapshots go.

The persistent tier follows the store's snapshot location — blocks beside the snapshot files
(``<dir>/blocks``) or in the snapshots' bucket (``<prefix>/blocks/``) — so a lone server keeps its
KV on its disk and replicas share theirs through S3. A host tier (process memory) sits in front
of it, and with S3 a bounded local disk may too::

    tiers = block_tiers(open_snapshot_storage("s3://kv/agentkv", default_dir=Path("kv")),
                        host_bytes=256 << 20, disk=Path("/var/cache/agentkv"), disk_bytes=8 << 30)
    store = BlockStore(tiers)
"""

from __future__ import annotations

from pathlib import Path

from agentkv.errors import UserError
from agentkv.kvstore.block_files import DiskBlocks
from agentkv.kvstore.block_tiers import BlockTier, HostBlocks
from agentkv.memory.snapshots import SnapshotFiles, SnapshotStorage

__all__ = ["DEFAULT_HOST_BYTES", "block_tiers"]

DEFAULT_HOST_BYTES = 256 << 20
"""Host memory kept for recently used KV blocks by default (a restore of a conversation this
process saved a moment ago, e.g. after a drain, reads no disk)."""


def block_tiers(files: SnapshotStorage, *, host_bytes: int | None = DEFAULT_HOST_BYTES, disk: Path | None = None,
                disk_bytes: int | None = None) -> list[BlockTier]:
    """The tiers, fastest first, for a store whose snapshots are ``files``: host memory of
    ``host_bytes`` (None or 0: none), ``disk`` (a local directory bounded by ``disk_bytes``; with a
    snapshot directory the blocks go there already, bounded by ``disk_bytes`` too), then the
    bucket when ``files`` is one."""
    for name, value in (("host_bytes", host_bytes), ("disk_bytes", disk_bytes)):
        if value is not None and value < 0:
            raise UserError(f"{name} must be >= 0 bytes (or None), got {value}")
    tiers: list[BlockTier] = []
    if host_bytes:
        tiers.append(HostBlocks(host_bytes))
    if isinstance(files, SnapshotFiles):
        if disk is not None and Path(disk).expanduser() != files.directory / "blocks":
            raise UserError(f"the KV blocks of a store whose snapshots are in the directory {files.directory} "
                            f"live in {files.directory / 'blocks'}; leave the disk tier unset (or use that path)")
        tiers.append(DiskBlocks(files.directory / "blocks", max_bytes=disk_bytes))
        return tiers
    if disk is not None:
        tiers.append(DiskBlocks(Path(disk).expanduser(), max_bytes=disk_bytes))
    from agentkv.memory.block_objects import ObjectBlocks
    from agentkv.memory.snapshot_objects import SnapshotObjects

    if not isinstance(files, SnapshotObjects):
        raise UserError(f"no block tier for snapshots stored by {type(files).__name__}")
    tiers.append(ObjectBlocks(files.bucket, files.prefix))  # NOTE: a client of its own, pooled for parallel transfers
    return tiers
