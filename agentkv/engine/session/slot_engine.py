"""SlotEngine: the ``Engine`` protocol over a ``SlotBackend`` — what every engine over KV slots shares.

The engine is the public face (``open_session``, ``register_prefix``, ``rope_convention``,
``aclose`` and the model facts); everything its sessions touch lives in its backend, which the
engine makes and keeps. Sessions hold the backend, never the engine, so neither calls the
other. Subclasses load a model (or a fake), build a backend over its slots and pass it up::

    class MyEngine(SlotEngine):
        def __init__(self) -> None:
            super().__init__(SlotBackend(slots=[...], tokenizer=tok, fingerprint="my-model:kv=f16",
                                         eos_token_ids={2}, max_context_len=4096, kv_bytes_per_token=1024))
"""

from __future__ import annotations

from collections.abc import Sequence

from agentkv.engine.base import Tokenizer
from agentkv.engine.counters import EngineCounters
from agentkv.kvstore.block_store import BlockStore
from agentkv.engine.session.backend import PrefixStore, SlotBackend
from agentkv.engine.session.session import SlotSession
from agentkv.engine.session.slot_pool import SlotPool
from agentkv.kv.block_keys import BLOCK_MULTIPLE, KVNamespace
from agentkv.kv.chunking import PrefixBoundaries
from agentkv.kv.rope import RopeConvention


class SlotEngine:
    """An engine whose sessions are ``SlotSession``s on one ``SlotBackend`` (no model here)."""

    session_class: type[SlotSession] = SlotSession
    """What ``open_session`` makes (the scripted engine's sessions reply from a script)."""

    def __init__(self, backend: SlotBackend) -> None:
        """Serve sessions on ``backend``: ``SlotEngine(SlotBackend(slots=..., ...))``."""
        self.backend = backend
        """The slots, KV handling, prefixes and open sessions this engine's sessions work through."""
        backend.pool.host.use_namespaces(self.kv_namespace)

    # ---- Engine protocol ---------------------------------------------------------------
    @property
    def tokenizer(self) -> Tokenizer:
        return self.backend.tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.backend.eos_token_ids

    @property
    def fingerprint(self) -> str:
        return self.backend.fingerprint

    @property
    def max_context_len(self) -> int:
        return self.backend.max_context_len

    @property
    def exact(self) -> bool:
        """False: an engine over slots alone says nothing of numerics (``OpenVINOEngine`` reads its
        plugin's; the scripted engine plays either)."""
        return False

    def kv_namespace(self, *, salt: str = "", block_size: int = BLOCK_MULTIPLE) -> KVNamespace:
        """What makes this engine's KV of the same tokens bit-identical, for tenant ``salt``: the
        namespace the KV store keys its blocks in (``kv/block_keys.py``)::

            space = engine.kv_namespace(salt="tenant-a")
            chain = space.chain(snapshot.tokens, cuts=snapshot.cuts)
        """
        return KVNamespace(salt=salt, fingerprint=self.fingerprint, layout=self._kv_layout(),
                           precision=self._kv_precision(), numerics=self._numerics_class(),
                           chunk_size=self.backend.prefill_chunk_size, block_size=block_size)

    def _kv_layout(self) -> str:
        """How a slot lays out its KV (the stateful and paged engines name theirs)."""
        return "slots"

    def _kv_precision(self) -> str:
        """The KV cache's element type (an engine over a model reads its plugin's)."""
        return "f32"

    def _numerics_class(self) -> str:
        """What decides the KV's bits beyond the tokens (an engine over a model: its plugin's numerics)."""
        return "exact" if self.exact else "close"

    async def open_session(self, *, salt: str = "") -> SlotSession:
        """A new empty session (bound to a slot when it first runs). ``salt`` names its tenant:
        it shares cached prefixes only with sessions of the same salt::

            session = await engine.open_session(salt="tenant-a")
        """
        return self.session_class(self.backend, salt=salt)

    def register_prefix(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Mark ``tokens`` as a shared prefix of tenant ``salt``: a chunk boundary of every
        prefill that covers it, and cached once a session of that tenant has read it (when the
        prefix cache is enabled): ``engine.register_prefix(system_ids)``."""
        self.backend.boundaries.register(tokens, salt=salt)

    async def rope_convention(self) -> RopeConvention | None:
        """The model's RoPE, measured once; None if no rotation explains the keys (span drops are
        then unavailable): ``await engine.rope_convention()``. Not while holding a slot lease."""
        return await self.backend.rope_convention()

    def keep_offloaded_kv_in(self, blocks: BlockStore, *, block_size: int) -> None:
        """Offload idle sessions' KV into ``blocks`` (the runtime's store's: saved snapshots and
        offloaded sessions then share one host tier, and an offload writes only blocks no save
        wrote): ``engine.keep_offloaded_kv_in(store.blocks, block_size=store.block_size)``."""
        self.backend.pool.host.use_blocks(blocks, block_size=block_size)

    async def aclose(self) -> None:
        """Close every open session, then stop the offload store's own writers: ``await engine.aclose()``."""
        try:
            await self.backend.close_sessions()
        finally:
            self.backend.pool.host.close()

    def counters(self) -> EngineCounters:
        """The slots as the KV blocks (bound ones used, leased ones active, idle bound ones
        evictable: offloaded on demand), the forward passes ``_model_steps`` counts, and the
        prompt tokens prefix-cache hits supplied: ``engine.counters().model_steps``."""
        pool = self.backend.pool
        active = len(pool.leased_slots())
        return EngineCounters(kv_blocks_used=pool.bound, kv_blocks_total=pool.size, kv_blocks_active=active,
                              kv_blocks_evictable=pool.bound - active,
                              model_steps=self._model_steps(), prefix_cache_hit_tokens=self.backend.prefix_hit_tokens)

    def _model_steps(self) -> int:
        """Forward passes run so far; an engine with a model counts them (none here)."""
        return 0

    # ---- what the backend holds, for callers and tests ------------------------------------
    @property
    def pool(self) -> SlotPool:
        """The slots sessions are bound to, and the host store of offloaded KV."""
        return self.backend.pool

    @property
    def prefix_cache(self) -> PrefixStore | None:
        """Shared prefixes' KV (None: off); ``engine.prefix_cache.stats()``."""
        return self.backend.prefix_cache

    @property
    def boundaries(self) -> PrefixBoundaries:
        """Registered prefixes: chunk boundaries of every prefill, cached or not."""
        return self.backend.boundaries

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the cache (all layers): ``engine.kv_bytes_per_token()``."""
        return self.backend.kv_bytes_per_token
