"""PagedEngine: the engine on the PagedAttention form of the model — sessions are block tables.

The same sessions, prefix cache, snapshots, offload and policies as ``StatefulEngine`` (a
session's ``KVLog`` runs on a ``PagedSlot`` instead of an InferRequest), over one compiled paged
model whose KV blocks all sessions share. A turn over a long history prefills ~3× faster than
the stateful form on CPU (``benchmarks/paged_step.py``)::

    engine = PagedEngine()                    # default model, f16 KV blocks, 512 MiB of them
    runtime = Runtime(engine)

Sessions that feed at the same time — decoding, or a prefill joining them — run as one model
step (``engine/step_batcher.py``; ``engine.batcher.stats()``), each with its own sampling,
constraint, stop and stream.

A prefix-cache hit points the new session's block table at the cached prefix's blocks (no
copy; ``engine/paged_prefix.py``); whoever writes into a shared block first copies it.

A fork shares its parent's blocks the same way (``hold_copy``): no KV is copied until one of
them writes into a shared block.

``kv_cache_precision="u8"`` keeps the blocks in the plugin's u8 layout (59 % of the bytes of
f16, parameters included); snapshots and offload of such sessions are the raw blocks, restored bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.from_thread

from agentkv.engine.paged.block_pool import BlockPool
from agentkv.kv.log import KVLog, KVSlot, KVSource
from agentkv.engine.paged.model import BLOCK_SIZE, PagedModel
from agentkv.engine.paged.prefix import PagedPrefixCache
from agentkv.engine.paged.slot import PagedSlot, blocks_for, read_raw_blocks, read_table
from agentkv.engine.session.session import SlotSession
from agentkv.engine.paged.shared_blocks import SharedBlocks
from agentkv.kv.snapshot import RAW_BLOCKS, KVSnapshot, PrecisionChoice
from agentkv.engine.stateful.engine import Backend, StatefulEngine
from agentkv.engine.paged.batcher import DEFAULT_MAX_TOKENS, StepBatcher
from agentkv.errors import KVLogCorrupt, UserError

DEFAULT_KV_CACHE_BYTES = 512 << 20
"""KV block storage of a ``PagedEngine`` (f16, default model: ~23,000 tokens)."""
DEFAULT_PREFILL_CHUNK = 1024
"""A long prefill runs as steps of at most this many tokens (cut at absolute multiples, so the
cuts are canonical): sessions decoding meanwhile wait one chunk, not the whole prompt.
NOTE: a turn that crosses a multiple runs as two steps — measured +26 ms (+13 %) for a 128-token
turn at ~1K history — so the chunk is not smaller: 1,024 bounds a decoder's wait to ~1 s here."""


class PagedEngine(StatefulEngine):
    """The local OpenVINO engine on the paged model. See the module docstring for a call."""

    @property
    def backend_tag(self) -> str:  # type: ignore[override]
        """":paged", plus a u8 cache's block shapes (its layout differs between CPUs, and raw
        blocks restore only into the same layout)."""
        if self.paged_model.kv_cache_precision != "u8":
            return ":paged"
        key, value = self.paged_model.block_shapes
        return ":paged:" + "x".join(map(str, key)) + "/" + "x".join(map(str, value))

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        num_slots: int = 16,
        max_batch: int | None = None,
        max_step_tokens: int = DEFAULT_MAX_TOKENS,
        prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
        **options: Any,
    ) -> None:
        """``kv_cache_bytes`` sizes the shared KV blocks; ``num_slots`` bounds the sessions that
        keep their KV in blocks at once (more are offloaded to host, as on the stateful engine).
        ``max_batch`` (default ``num_slots``; 1 turns batching off) and ``max_step_tokens`` cap
        what one model step takes from the sessions feeding at the same time.
        ``prefill_chunk_size`` (a multiple of the 32-token block; None: whole prompts) cuts long
        prefills into steps, so sessions decoding meanwhile get a step between chunks.
        Other options as ``StatefulEngine`` (``kv_cache_precision`` "f16", "f32" or "u8",
        ``exact``…). With u8 blocks, ``snapshot_precision`` "auto" or "u8" keeps the raw blocks."""
        if options.get("kv_cache_precision") == "bf16":
            raise UserError("the paged engine keeps f16, f32 or u8 KV blocks (f16 is typed bf16 by itself "
                            "when the plugin computes in bf16); pass kv_cache_precision='f16'")
        if kv_cache_bytes <= 0:
            raise UserError(f"kv_cache_bytes must be > 0, got {kv_cache_bytes}")
        if prefill_chunk_size is not None and (prefill_chunk_size < BLOCK_SIZE or prefill_chunk_size % BLOCK_SIZE):
            raise UserError(f"prefill_chunk_size must be a multiple of the {BLOCK_SIZE}-token block (or None), "
                            f"got {prefill_chunk_size}")
        if max_batch is not None and max_batch < 1:
            raise UserError(f"max_batch must be >= 1 (1: no batching), got {max_batch}")
        self._kv_cache_bytes = kv_cache_bytes
        self._max_batch = max_batch or num_slots
        self._max_step_tokens = max_step_tokens
        super().__init__(model, num_slots=num_slots, prefill_chunk_size=prefill_chunk_size, **options)
        self.block_pool.reclaim = self._reclaim_blocks
        self._kv_token_bytes = self.paged_model.block_bytes // BLOCK_SIZE
        self._raw_snapshots = self.kv_cache_precision == "u8" and self.snapshot_precision in ("auto", "u8")

    def make_snapshot(self, log: KVLog, slot: KVSlot) -> KVSnapshot:
        """Host snapshot of ``log``'s KV in ``slot``: a u8 cache's raw blocks (bit-exact, u8 size),
        else floats in the engine's snapshot precision (blocking)."""
        if not self._raw_snapshots:
            return super().make_snapshot(log, slot)
        assert isinstance(slot, PagedSlot)
        if slot.length() != len(log):
            raise KVLogCorrupt(f"the slot holds {slot.length()} positions but the log has {len(log)} tokens")
        blocks = slot.blocks[: blocks_for(len(log))]  # a failed feed may have grown the table already
        return self._raw_snapshot(log.tokens, blocks, shifted=log.shifted, lossless=log.exact)

    def _raw_snapshot(self, tokens: Sequence[int], blocks: Sequence[int], *, shifted: bool,
                      lossless: bool) -> KVSnapshot:
        keys, values = read_raw_blocks(self.paged_model, blocks)
        return KVSnapshot.from_blocks(tokens, keys, values, block_tokens=BLOCK_SIZE, fingerprint=self.fingerprint,
                                      shifted=shifted, lossless=lossless)

    def restores_exactly(self, snapshot: KVSource) -> bool:
        """Raw blocks and shared blocks give back the very bytes; floats as on any slot engine."""
        if isinstance(snapshot, SharedBlocks) or getattr(snapshot, "precision", None) == RAW_BLOCKS:
            return snapshot.lossless
        return super().restores_exactly(snapshot)

    def hold_copy(self, log: KVLog, slot: KVSlot) -> SharedBlocks:
        """A fork's copy of ``log``'s KV: references on the same blocks (no KV copied; the
        first write into a shared block copies that block)."""
        assert isinstance(slot, PagedSlot)
        blocks = list(slot.blocks)
        self.block_pool.share(blocks)
        return SharedBlocks(self.block_pool, log.tokens, blocks, shifted=log.shifted, lossless=log.exact,
                            read=self._snapshot_of_shared)

    def _snapshot_of_shared(self, shared: SharedBlocks) -> KVSnapshot:
        if self._raw_snapshots:
            return self._raw_snapshot(shared.tokens, shared.blocks, shifted=shared.shifted, lossless=shared.lossless)
        keys, values = read_table(self.paged_model, shared.blocks, shared.num_tokens)
        return self.snapshot_of(shared.tokens, keys, values, shifted=shared.shifted, lossless=shared.lossless)

    def _make_prefix_cache(self, budget_bytes: int | None, precision: PrecisionChoice) -> PagedPrefixCache:
        """Cached prefixes stay in the pool's blocks (``precision`` does not apply: nothing is
        converted); ``budget_bytes`` caps the blocks the cache alone keeps alive."""
        block = self.paged_model.block_bytes
        # NOTE: the plugin re-quantises a u8 block's keys as tokens join it, so there the last,
        # partly filled block of a prefix captured later is not what a cold prefill leaves
        return PagedPrefixCache(self.block_pool, boundaries=self.boundaries, block_bytes=block,
                                max_blocks=None if budget_bytes is None else budget_bytes // block,
                                exact_partial_blocks=self.paged_model.kv_cache_precision != "u8")

    def _reclaim_blocks(self, blocks_needed: int) -> None:
        """The block pool is short (called in a worker thread by an allocation): let the prefix
        cache go first, then move forks that have not run yet to host, then offload idle
        sessions, least recently used first, until ``blocks_needed`` blocks are free or nobody
        idle is left (then the allocation refuses)."""
        if isinstance(self.prefix_cache, PagedPrefixCache):
            self.prefix_cache.reclaim(blocks_needed)
        if self.block_pool.free_blocks >= blocks_needed or not _in_worker_thread():
            return
        anyio.from_thread.run(self._spill_unbound_forks, blocks_needed)
        while self.block_pool.free_blocks < blocks_needed:
            if not anyio.from_thread.run(self.pool.offload_idle):
                return

    async def _spill_unbound_forks(self, blocks_needed: int) -> None:
        """Move to host the KV of sessions that hold blocks without a slot (forks that have not
        run) and are the blocks' last holders, those freeing the most first."""
        def gain(session: SlotSession) -> int:
            held = session.held_kv
            if not isinstance(held, SharedBlocks):
                return 0
            return sum(1 for b in set(held.blocks) if self.block_pool.holders(b) == 1)

        for session in sorted(self._sessions, key=gain, reverse=True):
            if self.block_pool.free_blocks >= blocks_needed or gain(session) == 0:
                return
            await session.spill_held_blocks()

    def _open_backend(self, device: str, config: dict[str, str], num_slots: int, *, slice_logits: bool) -> Backend:
        """Compile the paged model and give each slot a block table over one shared pool."""
        # NOTE: the engine checked and merged its options already (exact=True is in ``config``)
        model = PagedModel(self.files, kv_cache_bytes=self._kv_cache_bytes, device=device,
                           kv_cache_precision=config["KV_CACHE_PRECISION"], ov_config=_extra(config))
        self.block_pool = BlockPool(model.num_blocks)
        """The KV blocks every session's table draws from."""
        self.paged_model = model
        self.batcher = StepBatcher(model.step, max_batch=self._max_batch, max_tokens=self._max_step_tokens)
        """Runs the feeds of sessions feeding at the same time as one step (``batcher.stats()``)."""
        slots = [PagedSlot(model, self.block_pool, self.batcher) for _ in range(num_slots)]
        return Backend(slots=slots, numerics=model.numerics, num_layers=model.num_layers, heads=model.heads,
                       head_dim=model.head_dim, vocab_size=model.vocab_size)


def _in_worker_thread() -> bool:
    """True in a worker thread of a running event loop (where ``anyio.from_thread`` works)."""
    try:
        anyio.from_thread.run_sync(lambda: None)
    except RuntimeError:
        return False
    return True


def _extra(config: dict[str, str]) -> dict[str, str]:
    """The plugin settings PagedModel does not set itself."""
    return {k: v for k, v in config.items() if k not in ("CACHE_DIR", "KV_CACHE_PRECISION")}
