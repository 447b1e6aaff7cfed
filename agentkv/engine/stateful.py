"""StatefulEngine: an OpenVINO stateful LLM compiled once, with a pool of InferRequests as KV slots.

::

    engine = StatefulEngine()                       # the default model, CPU, plugin's KV precision
    session = await engine.open_session()
    ids = engine.tokenizer.encode("Hello")
    result = await session.generate(ids, GenerationConfig(max_new_tokens=16))
    await engine.aclose()

Prefill computes logits for the last position only: a slice is inserted before the LM head
(``slice_logits=False`` keeps every position, for measuring the gain).

``prefix_cache_bytes`` (0 disables) and ``prefix_cache_precision`` size the shared prefix
cache (``engine.register_prefix``); ``offload_bytes`` bounds the host memory of offloaded
idle sessions, beyond which their KV is spilled to ``spill_dir`` files or dropped (re-prefilled).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import openvino as ov

from agentkv.engine.base import GenerationMetrics
from agentkv.engine.models import ModelFiles, compiled_cache_dir, resolve_model
from agentkv.engine.prefix_cache import PrefixCache
from agentkv.engine.session import StatefulSession
from agentkv.engine.session_common import EngineCommon
from agentkv.engine.slot import Slot
from agentkv.engine.slots import HostKVStore, SlotPool
from agentkv.engine.snapshot import KVSnapshot
from agentkv.engine.tokenizer import OVTokenizer
from agentkv.errors import ConstraintError, UserError

if TYPE_CHECKING:
    from agentkv.engine.constraints import ConstraintFactory, GrammarConstraint

KVPrecision = Literal["u8", "f16", "f32"]
_OV_PRECISION = {"u8": "u8", "f16": "f16", "f32": "f32"}
_BYTES = {"u8": 1, "f16": 2, "f32": 4}
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


class StatefulEngine(EngineCommon):
    """The local OpenVINO engine. See the module docstring for a call."""

    session_class = StatefulSession

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        device: str = "CPU",
        kv_cache_precision: KVPrecision | None = None,
        num_slots: int = 4,
        max_context_len: int | None = None,
        prefill_chunk_size: int | None = None,
        slice_logits: bool = True,
        snapshot_precision: Literal["auto", "f32", "f16", "u8"] = "auto",
        ov_config: dict[str, str] | None = None,
        prefix_cache_bytes: int | None = DEFAULT_PREFIX_CACHE_BYTES,
        prefix_cache_precision: Literal["f32", "f16", "u8"] = "f16",
        offload_bytes: int | None = DEFAULT_OFFLOAD_BYTES,
        spill_dir: str | os.PathLike[str] | None = None,
    ) -> None:
        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        if kv_cache_precision is not None and kv_cache_precision not in _OV_PRECISION:
            raise UserError(f"kv_cache_precision must be one of u8, f16, f32, got {kv_cache_precision!r}")
        self.files: ModelFiles = resolve_model(model)
        self.device = device
        self.prefill_chunk_size = prefill_chunk_size
        self._tokenizer = OVTokenizer(self.files.ir_dir)
        core = ov.Core()
        ov_model = core.read_model(str(self.files.model_xml))
        self.logits_sliced = slice_logits and slice_last_position(ov_model)
        config: dict[str, str] = {"CACHE_DIR": str(compiled_cache_dir())}
        if kv_cache_precision is not None:
            config["KV_CACHE_PRECISION"] = _OV_PRECISION[kv_cache_precision]
        config.update(ov_config or {})
        self._compiled = core.compile_model(ov_model, device, config)
        self.kv_cache_precision: str = _read_kv_precision(self._compiled, kv_cache_precision)
        self.snapshot_precision = (
            ("f32" if self.kv_cache_precision == "f32" else "f16")
            if snapshot_precision == "auto"
            else snapshot_precision
        )
        inputs = frozenset(name for i in ov_model.inputs for name in i.get_names())
        slots = [Slot(self._compiled.create_infer_request(), i, inputs) for i in range(num_slots)]
        self.pool = SlotPool(slots, host=HostKVStore(offload_bytes, spill_dir))
        first = slots[0].layout
        self.num_layers = first.num_layers
        self._max_context_len = max_context_len or _context_length(self.files) or DEFAULT_CONTEXT_LEN
        self._fingerprint = _fingerprint(self.files.model_xml, self.kv_cache_precision, device)
        self._eos = frozenset({self._tokenizer.eos_token_id})
        self._sessions: set[StatefulSession] = set()
        self._constraints: ConstraintFactory | None = None
        self._vocab_size = int(ov_model.output("logits").get_partial_shape()[2].get_length())
        heads, head_dim = _state_head_shape(slots[0])
        self._kv_token_bytes = 2 * self.num_layers * heads * head_dim * _BYTES[self.kv_cache_precision]
        self.prefix_cache: PrefixCache | None = None  # prefix_cache_bytes=0 disables it
        if prefix_cache_bytes != 0:
            self.prefix_cache = PrefixCache(
                fingerprint=self._fingerprint, budget_bytes=prefix_cache_bytes,
                precision=prefix_cache_precision, limiter=self.pool.limiter,
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
        """Mark ``tokens`` as a shared prefix (cached once the prefix cache is enabled)."""
        if self.prefix_cache is not None:
            self.prefix_cache.register(tokens)

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
    def make_snapshot(
        self, tokens: Sequence[int], keys: np.ndarray, values: np.ndarray, shifted: bool
    ) -> KVSnapshot:
        """Host snapshot of float32 KV arrays in this engine's snapshot precision."""
        return KVSnapshot.from_float(
            tuple(tokens),
            keys,
            values,
            precision=self.snapshot_precision,  # type: ignore[arg-type]
            fingerprint=self._fingerprint,
            shifted=shifted,
        )

    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V take in the model's cache precision (all layers)."""
        return self._kv_token_bytes

    def metrics_for(
        self, session: StatefulSession, align: dict[str, int], *, generated: int, ttft: float, tpot: float
    ) -> GenerationMetrics:
        """Metrics of one call from the alignment counts."""
        kv_tokens = len(session.tokens)
        return GenerationMetrics(
            prompt_tokens=align["reused"] + align["prefix_cache"] + align["prefilled"],
            reused_tokens=align["reused"],
            prefix_cache_tokens=align["prefix_cache"],
            restored_tokens=align["restored"],
            prefilled_tokens=align["prefilled"],
            generated_tokens=generated,
            ttft_s=ttft,
            tpot_s=tpot,
            kv_tokens=kv_tokens,
            kv_bytes=kv_tokens * self.kv_bytes_per_token(),
        )

    def prefix_cache_lookup(self, prompt: Sequence[int], reused: int) -> KVSnapshot | None:
        """The longest cached prefix of ``prompt`` that adds at least ``MIN_PREFIX_HIT_TOKENS``
        to the ``reused`` tokens the session already holds (and leaves one token to prefill)."""
        if self.prefix_cache is None:
            return None
        # NOTE: a hit of a few tokens (e.g. a shared "<|im_start|>system\nYou are a") costs a
        # KV copy bigger than the prefill it saves, and with a quantised cache it perturbs the
        # logits like a chunk boundary would: not worth taking.
        return self.prefix_cache.lookup(prompt, longer_than=reused + MIN_PREFIX_HIT_TOKENS - 1)

    async def prefix_cache_store(self, session: StatefulSession, slot: Slot) -> None:
        """Give the prefix cache a chance to copy registered prefixes out of ``slot``."""
        if self.prefix_cache is not None:
            await self.prefix_cache.capture(session, slot)


def _state_head_shape(slot: Slot) -> tuple[int, int]:
    """(heads, head_dim) of the KV states, read from a fresh request's ``[0, H, 0, D]`` state."""
    shape = slot.request.query_state()[0].state.shape
    return int(shape[1]), int(shape[3])


def _read_kv_precision(compiled: ov.CompiledModel, requested: str | None) -> str:
    try:
        value = str(compiled.get_property("KV_CACHE_PRECISION")).lower()
    except RuntimeError:
        return requested or "f32"
    for name in ("u8", "f16", "f32", "bf16"):
        if name in value or {"u8": "uint8", "f16": "f16", "f32": "f32", "bf16": "bf16"}[name] in value:
            return "f16" if name == "bf16" else name
    return requested or "f32"


def _context_length(files: ModelFiles) -> int | None:
    """The model's trained context length, from GGUF metadata or config.json."""
    import json

    config = files.ir_dir / "config.json"
    if config.is_file():
        value = json.loads(config.read_text()).get("max_position_embeddings")
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
