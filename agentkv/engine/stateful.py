"""StatefulEngine: an OpenVINO stateful LLM compiled once, with a pool of InferRequests as KV slots.

::

    engine = StatefulEngine()                       # the default model, CPU, f16 KV cache
    exact = StatefulEngine(exact=True)              # f32 KV, f32 compute, no dynamic quantisation
    session = await engine.open_session()
    ids = engine.tokenizer.encode("Hello")
    result = await session.generate(ids, GenerationConfig(max_new_tokens=16))
    await engine.aclose()

Prefill computes logits for the last position only: a slice is inserted before the LM head
(``slice_logits=False`` keeps every position, for measuring the gain).

``prefix_cache_bytes`` (0 disables) and ``prefix_cache_precision`` size the shared prefix
cache (``engine.register_prefix``); ``offload_bytes`` bounds the host memory of offloaded
idle sessions, beyond which their KV is spilled to ``spill_dir`` files or dropped (re-prefilled).

The KV cache is f16 by default, not the plugin's u8: the state API cannot give a u8 cache back
its own values (it quantises the dequantised values again), so host offload, snapshots and
prefix-cache hits would not be bit-exact. ``kv_cache_precision="u8"`` is allowed; such restores
are then reported with ``GenerationMetrics.kv_exact == False``. What is bit-exact and what is
only close is listed in ``engine/numerics.py``.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import openvino as ov

import anyio

from agentkv.engine.base import Alignment, GenerationMetrics
from agentkv.engine.chunking import PrefixBoundaries
from agentkv.engine.kv_log import KVLog, KVSlot
from agentkv.engine.models import ModelFiles, compiled_cache_dir, resolve_model
from agentkv.engine.numerics import EXACT_CONFIG, PluginNumerics
from agentkv.engine.prefix_cache import PrefixCache
from agentkv.engine.rope import FIT_TOLERANCE, PROBE_TEXT, RopeConvention, measure_convention, rope_metadata
from agentkv.engine.session import StatefulSession
from agentkv.engine.session_common import EngineCommon
from agentkv.engine.slot import Slot
from agentkv.engine.slot_pool import HostKVStore, SlotPool
from agentkv.engine.snapshot import KVSnapshot, PrecisionChoice
from agentkv.engine.tokenizer import OVTokenizer
from agentkv.errors import AgentKVError, ConstraintError, UserError

if TYPE_CHECKING:
    from agentkv.engine.constraints import ConstraintFactory, GrammarConstraint

logger = logging.getLogger(__name__)

KVPrecision = Literal["u8", "f16", "bf16", "f32"]
_BYTES = {"u8": 1, "f16": 2, "bf16": 2, "f32": 4}
DEFAULT_KV_PRECISION: KVPrecision = "f16"
"""The smallest KV cache whose restores are bit-exact (see the module docstring)."""
DEFAULT_CONTEXT_LEN = 8192
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
MIN_PREFIX_HIT_TOKENS = 16
"""A prefix-cache hit is used only when it saves at least this many tokens of prefill."""
DEFAULT_OFFLOAD_BYTES = 2 << 30


def slice_last_position(model: ov.Model) -> bool:
    """Insert ``hidden[:, -1:, :]`` before the LM head MatMul so logits cover the last position.

    Returns False (model unchanged) when the graph does not end in Result ← MatMul.
    """
    import openvino.opset13 as ops

    logits = next((o for o in model.outputs if "logits" in o.get_names()), None)
    if logits is None:
        return False
    matmul = logits.get_node().input_value(0).get_node()
    if matmul.get_type_name() != "MatMul":
        return False
    hidden = matmul.input_value(0)
    sliced = ops.slice(
        hidden,
        np.array([-1], dtype=np.int64),
        np.array([np.iinfo(np.int64).max], dtype=np.int64),
        np.array([1], dtype=np.int64),
        np.array([1], dtype=np.int64),
    )
    matmul.input(0).replace_source_output(sliced.output(0))
    model.validate_nodes_and_infer_types()
    return True


@dataclass(frozen=True)
class Backend:
    """What an engine's KV backend provides: its slots and the model's shape."""

    slots: Sequence[KVSlot]
    numerics: PluginNumerics
    num_layers: int
    heads: int
    head_dim: int
    vocab_size: int


class StatefulEngine(EngineCommon):
    """The local OpenVINO engine. See the module docstring for a call."""

    session_class = StatefulSession

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str = "CPU",
        kv_cache_precision: KVPrecision | None = None,
        exact: bool = False,
        num_slots: int = 4,
        max_context_len: int | None = None,
        prefill_chunk_size: int | None = None,
        slice_logits: bool = True,
        snapshot_precision: PrecisionChoice = "auto",
        ov_config: dict[str, str] | None = None,
        prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_cache_precision: PrecisionChoice = "auto",
        offload_bytes: int | None = DEFAULT_OFFLOAD_BYTES,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        """``exact=True`` compiles with ``numerics.EXACT_CONFIG`` (f32 KV, f32 compute, dynamic
        quantisation off): a prefill's logits then do not depend on its chunking, on any CPU.
        ``ov_config`` entries are applied last (e.g. ``{"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}``).
        ``snapshot_precision`` / ``prefix_cache_precision`` "auto" store KV losslessly."""
        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        if kv_cache_precision is not None and kv_cache_precision not in _BYTES:
            raise UserError(f"kv_cache_precision must be one of u8, f16, bf16, f32, got {kv_cache_precision!r}")
        if exact and kv_cache_precision not in (None, "f32"):
            raise UserError(f"exact=True needs an f32 KV cache, got kv_cache_precision={kv_cache_precision!r}; "
                            "drop one of the two")
        self.files: ModelFiles = resolve_model(model)
        self.prefill_chunk_size = prefill_chunk_size
        self._tokenizer = OVTokenizer(self.files.ir_dir)
        requested_kv = kv_cache_precision or ("f32" if exact else DEFAULT_KV_PRECISION)
        config: dict[str, str] = {"CACHE_DIR": str(compiled_cache_dir())}
        config.update(EXACT_CONFIG if exact else {})
        config["KV_CACHE_PRECISION"] = requested_kv
        config.update(ov_config or {})
        backend = self._open_backend(device, config, num_slots, slice_logits=slice_logits)
        self.numerics = backend.numerics
        """What the plugin computes in on this machine (read back, not what was asked)."""
        self.kv_cache_precision: str = self.numerics.kv_cache
        self.snapshot_precision: PrecisionChoice = snapshot_precision
        self.pool = SlotPool(backend.slots, host=HostKVStore(offload_bytes, spill_dir))  # type: ignore[arg-type]
        self.num_layers = backend.num_layers
        self._max_context_len = max_context_len or _context_length(self.files) or DEFAULT_CONTEXT_LEN
        self._fingerprint = _fingerprint(self.files.model_xml, self.kv_cache_precision, device)
        self._eos = frozenset({self._tokenizer.eos_token_id})
        self._sessions: set[StatefulSession] = set()
        self._constraints: ConstraintFactory | None = None
        self._vocab_size = backend.vocab_size
        self._kv_token_bytes = (2 * self.num_layers * backend.heads * backend.head_dim
                                * _BYTES.get(self.kv_cache_precision, 4))
        self.boundaries = PrefixBoundaries()
        """Registered prefixes: chunk boundaries of every prefill, cached or not (canonical chunking)."""
        self.prefix_cache: PrefixCache | None = None  # prefix_cache_bytes=0 disables it
        if prefix_cache_bytes != 0:
            self.prefix_cache = PrefixCache(
                fingerprint=self._fingerprint, budget_bytes=prefix_cache_bytes,
                precision=prefix_cache_precision, limiter=self.pool.limiter, boundaries=self.boundaries,
            )
        self._rope: RopeConvention | None = None
        self._rope_measured = False
        self._rope_lock = anyio.Lock()

    def _open_backend(self, device: str, config: dict[str, str], num_slots: int, *, slice_logits: bool) -> Backend:
        """Compile the stateful model; each InferRequest is one KV slot."""
        core = ov.Core()
        ov_model = core.read_model(str(self.files.model_xml))
        if slice_logits:
            slice_last_position(ov_model)
        compiled = _compile(core, ov_model, device, config)
        inputs = frozenset(name for i in ov_model.inputs for name in i.get_names())
        slots = [Slot(compiled.create_infer_request(), i, inputs) for i in range(num_slots)]
        heads, head_dim = _state_head_shape(slots[0])
        return Backend(
            slots=slots, numerics=PluginNumerics.of(compiled, config["KV_CACHE_PRECISION"]),
            num_layers=slots[0].layout.num_layers, heads=heads, head_dim=head_dim,
            vocab_size=int(ov_model.output("logits").get_partial_shape()[2].get_length()),
        )

    # ---- Engine protocol ---------------------------------------------------------------
    @property
    def tokenizer(self) -> OVTokenizer:
        return self._tokenizer

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def register_prefix(self, tokens: Sequence[int]) -> None:
        """Mark ``tokens`` as a shared prefix: a chunk boundary of every prefill that covers it,
        and cached once a session has read it (when the prefix cache is enabled)."""
        self.boundaries.register(tokens)

    async def rope_convention(self) -> RopeConvention | None:
        """The model's RoPE (θ from its metadata, verified on its keys), measured once on a
        temporary session's slot; None if no rotation explains the keys (then span drops are
        unavailable). Must not be called while holding a slot lease (it needs a slot)."""
        async with self._rope_lock:
            if not self._rope_measured:
                self._rope = await self._measure_rope()
                self._rope_measured = True
        return self._rope

    async def _measure_rope(self) -> RopeConvention | None:
        metadata = rope_metadata(self.files.config(), self.files.gguf_metadata())
        floor = FIT_TOLERANCE.get(self.kv_cache_precision, max(FIT_TOLERANCE.values()))
        ids = self._tokenizer.encode(PROBE_TEXT)
        probe = self.new_session()
        try:
            async with self.pool.lease(probe) as slot:
                return await anyio.to_thread.run_sync(
                    lambda: measure_convention(slot, ids, floor=floor, metadata=metadata),
                    limiter=self.pool.limiter,
                )
        except AgentKVError as error:
            logger.warning("cannot measure the model's RoPE convention: %s", error)
            return None
        finally:
            await probe.close()

    def make_constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh grammar constraint (llguidance Lark grammar) for one generation::

            c = engine.make_constraint(tool_call_grammar(agent.tool_schemas, "required"))
            await session.generate(ids, cfg, constraint=c)
        """
        if self._constraints is None:
            meta = self.files.gguf_metadata()
            if "tokenizer.ggml.tokens" not in meta:
                raise ConstraintError(
                    "grammar-constrained decoding needs the model's vocabulary, read from its GGUF file; "
                    "put the .gguf next to the IR or set Agent(constrain_tool_calls=False)"
                )
            from agentkv.engine.constraints import ConstraintFactory

            self._constraints = ConstraintFactory(
                meta["tokenizer.ggml.tokens"],
                eos_token_id=sorted(self._eos),
                vocab_size=self._vocab_size,
                token_types=meta.get("tokenizer.ggml.token_type"),
                encode=self._tokenizer.encode,
            )
        return self._constraints(grammar)

    # ---- helpers used by sessions ------------------------------------------------------
    def new_log(self) -> KVLog:
        """An empty token log that cuts its prefills canonically for this engine."""
        return KVLog(boundaries=self.boundaries, chunk_size=self.prefill_chunk_size)

    def make_snapshot(self, log: KVLog, keys: np.ndarray, values: np.ndarray) -> KVSnapshot:
        """Host snapshot of ``log``'s float32 KV arrays in this engine's snapshot precision
        ("auto": lossless); an inexact log's snapshot says so."""
        return KVSnapshot.from_float(
            tuple(log.tokens),
            keys,
            values,
            precision=self.snapshot_precision,
            fingerprint=self._fingerprint,
            shifted=log.shifted,
            lossless=log.exact,
        )

    def restores_exactly(self, snapshot: KVSnapshot) -> bool:
        """True when writing ``snapshot`` into a slot gives the KV it was read from, bit for bit."""
        return snapshot.lossless and self.numerics.restores_exact

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the model's cache precision (all layers)."""
        return self._kv_token_bytes

    def metrics_for(
        self, log: KVLog, align: Alignment, *, generated: int, ttft: float, tpot: float
    ) -> GenerationMetrics:
        """Metrics of one call from its alignment and the log it left."""
        return align.metrics(generated=generated, ttft=ttft, tpot=tpot, kv_tokens=len(log),
                             kv_bytes=len(log) * self.kv_bytes_per_token(), kv_exact=log.exact)

    def prefix_cache_lookup(self, prompt: Sequence[int], reused: int) -> KVSnapshot | None:
        """The longest cached *registered* prefix of ``prompt`` that adds at least
        ``MIN_PREFIX_HIT_TOKENS`` to the ``reused`` tokens the session holds and leaves one
        token to prefill.

        NOTE: whole registered prefixes only: they are chunk boundaries of a cold prefill too,
        so a hit computes exactly what a cold start would. A hit of a few tokens (a shared
        "<|im_start|>system\nYou are a") would cost a KV copy bigger than the prefill it saves."""
        if self.prefix_cache is None:
            return None
        for mark in reversed(self.boundaries.prefixes_of(prompt)):
            if len(mark) < len(prompt) and len(mark) >= reused + MIN_PREFIX_HIT_TOKENS:
                if self.prefix_cache.match_len(mark) == len(mark):
                    return self.prefix_cache.lookup(prompt[: len(mark) + 1], longer_than=len(mark) - 1)
        return None

    async def prefix_cache_store(self, session: StatefulSession, slot: Slot) -> None:
        """Give the prefix cache a chance to copy registered prefixes out of ``slot``."""
        if self.prefix_cache is not None:
            await self.prefix_cache.capture(session, slot)


def _state_head_shape(slot: Slot) -> tuple[int, int]:
    """(heads, head_dim) of the KV states, read from a fresh request's ``[0, H, 0, D]`` state."""
    shape = slot.request.query_state()[0].state.shape
    return int(shape[1]), int(shape[3])


def _compile(core: ov.Core, model: ov.Model, device: str, config: dict[str, str]) -> ov.CompiledModel:
    """``core.compile_model``; a failure (e.g. a device this machine lacks) is a ``UserError``
    naming the devices it has."""
    try:
        return core.compile_model(model, device, config)
    except RuntimeError as error:
        available = list(core.available_devices)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        cause = next((line for line in lines if not line.startswith("Exception from")), type(error).__name__)
        raise UserError(f"OpenVINO could not compile the model for device {device!r} ({cause}); this "
                        f"machine has {available}: pass one of those, e.g. StatefulEngine(device={available[0]!r})"
                        ) from error


def _context_length(files: ModelFiles) -> int | None:
    """The model's trained context length, from GGUF metadata or config.json."""
    config = files.config()
    if config:
        value = config.get("max_position_embeddings")
        return int(value) if value else None
    for name, value in files.gguf_metadata().items():
        if name.endswith(".context_length"):
            return int(value)
    return None


def _fingerprint(model_xml: Path, kv_precision: str, device: str) -> str:
    digest = hashlib.sha256()
    digest.update(model_xml.read_bytes())
    weights = model_xml.with_suffix(".bin")
    digest.update(str(weights.stat().st_size if weights.exists() else 0).encode())
    return f"{model_xml.parent.name}:{digest.hexdigest()[:16]}:kv={kv_precision}:{device}"
