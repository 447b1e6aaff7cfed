"""SharedBlocks: KV held as references on paged blocks — a prefix-cache hit, or a fork's copy that copies nothing.

It is a ``KVSource`` (``write_into`` points a paged slot's table at the blocks) and the
``OffloadedKV`` a forked session keeps until it gets a slot. It holds one reference on each block
until ``write_into`` hands them to a slot or ``release`` lets go, whichever comes first; whoever
later writes into a block others hold copies it first (``BlockTable``'s copy-on-write)::

    pool.share(slot.blocks)
    held = SharedBlocks(pool, tokens, slot.blocks, cuts=log.cuts, read=backend.snapshot_of_shared)
    held.write_into(other_slot)        # other_slot's table: the same blocks
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.kv.log import KVSlot
from agentkv.engine.paged.block_table import table_of
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kv.snapshot_cuts import checked_cuts
from agentkv.errors import UserError


class SharedBlocks:
    """Tokens and the blocks that hold their KV, with one reference held on each."""

    in_pool = True
    """Its KV occupies pool blocks (a session holding it can spill it to host: ``spill_held_blocks``)."""

    def __init__(
        self,
        pool: BlockPool,
        tokens: Sequence[int],
        blocks: Sequence[int],
        *,
        shifted: bool = False,
        lossless: bool = True,
        cuts: Sequence[int] | None = None,
        read: Callable[[SharedBlocks], KVSnapshot] | None = None,
    ) -> None:
        """``blocks``: references already taken for this object. ``cuts``: where the passes that
        computed the KV began (``KVLog.cuts``; None: unknown). ``read`` makes a host snapshot
        of them (``load``); without it ``load`` is refused."""
        self.tokens = tuple(int(t) for t in tokens)
        self.cuts = checked_cuts(cuts, len(self.tokens))
        """Where the passes that computed this KV began (sorted, in ``[0, num_tokens)``), or None."""
        self.blocks = tuple(int(b) for b in blocks)
        self.shifted = shifted
        self.lossless = lossless
        self._pool = pool
        self._read = read
        self._held = True
        self._lock = threading.Lock()

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def write_into(self, slot: KVSlot) -> None:
        """Make ``slot``'s table these blocks (it takes over the references)."""
        table = table_of(slot)
        if table is None:
            raise UserError("shared blocks go into a paged slot; use a KVSnapshot for other engines")
        with self._lock:
            if not self._held:
                raise UserError("these shared blocks were handed over or released already")
            self._held = False
        table.attach(list(self.blocks), len(self.tokens))

    def take(self) -> SharedBlocks:
        """Itself, to be loaded (``OffloadedKV``): its references go to the slot it is written into."""
        return self

    def load(self) -> KVSnapshot:
        """A host snapshot of the blocks' KV (blocking)."""
        if self._read is None:
            raise UserError("these shared blocks have no reader: write them into a paged slot instead")
        with self._lock:
            if not self._held:
                raise UserError("these shared blocks were handed over or released already")
            return self._read(self)

    def release(self) -> None:
        """Drop the references still held (idempotent)."""
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._pool.release(self.blocks)
