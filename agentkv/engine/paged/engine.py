"""PagedEngine: the engine on the PagedAttention form of the model — sessions are block tables.

The same sessions, prefix cache, snapshots, offload and policies as its sibling
``StatefulEngine`` (both are ``OpenVINOEngine``s; a session's ``KVLog`` runs on a ``PagedSlot``
instead of an InferRequest), over one compiled paged model whose KV blocks all sessions share;
what the blocks change for sessions is in its backend (``engine/paged/backend.py``). A turn over
a long history prefills ~3× faster than the stateful form on CPU (``benchmarks/paged_step.py``)::

    engine = PagedEngine()                    # default model, f16 KV blocks, 512 MiB of them
    runtime = Runtime(engine)

Sessions that feed at the same time — decoding, or a prefill joining them — run as one model
step (``engine/paged/batcher.py``; ``engine.batcher.stats()``), each with its own sampling,
constraint, stop and stream.

A prefix-cache hit points the new session's block table at the cached prefix's blocks (no
copy; ``engine/paged/prefix.py``); whoever writes into a shared block first copies it.

A fork shares its parent's blocks the same way (``PagedBackend.hold``): no KV is copied until one of
them writes into a shared block.

``kv_cache_precision="u8"`` keeps the blocks in the plugin's u8 layout (59 % of the bytes of
f16, parameters included); snapshots and offload of such sessions are the raw blocks, restored bit for bit.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import anyio

from agentkv.engine.counters import EngineCounters
from agentkv.engine.openvino.engine import CompiledSlots, OpenVINOEngine
from agentkv.engine.paged.backend import PagedBackend
from agentkv.engine.paged.batcher import DEFAULT_MAX_TOKENS, StepBatcher
from agentkv.engine.paged.block_pool import BLOCK_SIZE, BlockPool
from agentkv.engine.paged.model import PagedModel
from agentkv.engine.paged.slot import PagedSlot
from agentkv.errors import UserError

DEFAULT_KV_CACHE_BYTES = 512 << 20
"""KV block storage of a ``PagedEngine`` (f16, default model: ~23,000 tokens)."""
DEFAULT_PREFILL_CHUNK = 1024
"""A long prefill runs as steps of at most this many tokens (cut at absolute multiples, so the
cuts are canonical): sessions decoding meanwhile wait one chunk, not the whole prompt.
NOTE: a turn that crosses a multiple runs as two steps — measured +26 ms (+13 %) for a 128-token
turn at ~1K history — so the chunk is not smaller: 1,024 bounds a decoder's wait to ~1 s here."""


class PagedEngine(OpenVINOEngine):
    """The local OpenVINO engine on the paged model. See the module docstring for a call."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        num_slots: int = 16,
        max_batch: int | None = None,
        max_step_tokens: int = DEFAULT_MAX_TOKENS,
        prefill_chunk_size: int | None = DEFAULT_PREFILL_CHUNK,
        chunk_graph: bool | None = None,
        small_graph: bool | None = None,
        **options: Any,
    ) -> None:
        """``kv_cache_bytes`` sizes the shared KV blocks; ``num_slots`` bounds the sessions that
        keep their KV in blocks at once (more are offloaded to host, as on the stateful engine).
        ``max_batch`` (default ``num_slots``; 1 turns batching off) and ``max_step_tokens`` cap
        what one model step takes from the sessions feeding at the same time.
        ``prefill_chunk_size`` (a multiple of the 32-token block; None: whole prompts) cuts long
        prefills into steps, so sessions decoding meanwhile get a step between chunks.
        ``chunk_graph`` compiles the model again for steps that feed several tokens of a sequence
        (prefill chunks, draft verifies, forced tokens), so one-token decode steps keep their
        graph's shapes (``PagedModel``; a shape change costs 15–25 ms beside a ~25 ms step on 2
        cores), and a third time for a sequence's steps of at most 4 tokens (a small draft's
        verify); None: on CPU when the weights file is at most 1 GiB (each graph holds a copy of
        the compiled weights: +80–130 MB for the default model). ``small_graph`` turns that third
        graph on or off (True needs the chunk graph); None: on CPU when the weights file is at
        most 256 MiB. ``PagedEngine(small_graph=False)`` spares its memory; quoting with drafts
        is then ~6 % slower (measured on an avx2 CPU).
        Other options as ``OpenVINOEngine`` (``kv_cache_precision`` "f16", "f32" or "u8",
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
        self._chunk_graph, self._small_graph = chunk_graph, small_graph
        super().__init__(model, num_slots=num_slots, prefill_chunk_size=prefill_chunk_size, **options)

    def _kv_layout(self) -> str:
        return "paged"

    def _fingerprint_tag(self) -> str:
        """":paged", plus a u8 cache's block shapes (its layout differs between CPUs, and raw
        blocks restore only into the same layout)."""
        if self.paged_model.kv_cache_precision != "u8":
            return ":paged"
        key, value = self.paged_model.block_shapes
        return ":paged:" + "x".join(map(str, key)) + "/" + "x".join(map(str, value))

    def _compile(self, device: str, config: dict[str, str], num_slots: int) -> CompiledSlots:
        """Compile the paged model and give each slot a block table over one shared pool."""
        # NOTE: the engine checked and merged its options already (exact=True is in ``config``)
        model = PagedModel(self.files, kv_cache_bytes=self._kv_cache_bytes, device=device,
                           kv_cache_precision=config["KV_CACHE_PRECISION"], ov_config=_extra(config),
                           chunk_graph=self._chunk_graph, small_graph=self._small_graph)
        self.block_pool = BlockPool(model.num_blocks)
        """The KV blocks every session's table draws from."""
        self.paged_model = model
        self.batcher = StepBatcher(model.step, max_batch=self._max_batch, max_tokens=self._max_step_tokens)
        """Runs the feeds of sessions feeding at the same time as one step (``batcher.stats()``)."""
        slots = [PagedSlot(model, self.block_pool, self.batcher) for _ in range(num_slots)]
        return CompiledSlots(slots=slots, numerics=model.numerics, num_layers=model.num_layers,
                             vocab_size=model.vocab_size, kv_bytes_per_token=model.block_bytes // BLOCK_SIZE)

    async def aclose(self) -> None:
        """Close every session, then release the paged model (its KV blocks; its compiled graphs
        go to the next engine on the same model when ``AGENTKV_KEEP_COMPILED`` allows):
        ``await engine.aclose()``."""
        try:
            await super().aclose()
        finally:  # NOTE: in a thread: release waits for a step in flight, the event loop does not
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(self.paged_model.release)

    def counters(self) -> EngineCounters:
        """The pool's blocks (held by sessions, forks or cached prefixes: used; in the tables of
        sessions running a call, or reserved for a step: active; the other held ones:
        evictable), the model's forward passes (batched, beam and probe steps) and the prompt
        tokens cached prefixes supplied: ``engine.counters().kv_blocks_active``."""
        pool = self.block_pool
        running = {block for slot in self.backend.pool.leased_slots() if isinstance(slot, PagedSlot)
                   for row in slot.table.rows for block in row}
        used = pool.num_blocks - pool.free_blocks
        return replace(super().counters(), kv_blocks_total=pool.num_blocks, kv_blocks_used=used,
                       kv_blocks_active=len(running) + pool.reserved_blocks, kv_blocks_evictable=used - len(running))

    def _model_steps(self) -> int:
        return self.paged_model.steps_run

    def _make_backend(self, **options: Any) -> PagedBackend:
        """Sessions work through the block pool: shared blocks, raw snapshots, room made before a step."""
        return PagedBackend(self.paged_model, self.block_pool, **options)


def _extra(config: dict[str, str]) -> dict[str, str]:
    """The plugin settings PagedModel does not set itself."""
    return {k: v for k, v in config.items() if k not in ("CACHE_DIR", "KV_CACHE_PRECISION")}
