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
import os
from dataclasses import dataclass
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import openvino as ov

from agentkv.engine.openvino.compile import compile_for_device
from agentkv.kv.log import KVSlot
from agentkv.engine.openvino.models import ModelFiles, compiled_cache_dir, resolve_model
from agentkv.engine.openvino.numerics import EXACT_CONFIG, PluginNumerics
from agentkv.kv.rope import FIT_TOLERANCE, rope_metadata
from agentkv.engine.stateful.slot import StatefulSlot
from agentkv.engine.session.slot_engine import SlotEngine
from agentkv.kv.snapshot import PrecisionChoice
from agentkv.engine.openvino.tokenizer import OVTokenizer
from agentkv.errors import ConstraintError, UserError

if TYPE_CHECKING:
    from agentkv.engine.decode.constraints import ConstraintFactory, GrammarConstraint

KVPrecision = Literal["u8", "f16", "bf16", "f32"]
_BYTES = {"u8": 1, "f16": 2, "bf16": 2, "f32": 4}
DEFAULT_KV_PRECISION: KVPrecision = "f16"
"""The smallest KV cache whose restores are bit-exact (see the module docstring)."""
DEFAULT_CONTEXT_LEN = 8192
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
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


class StatefulEngine(SlotEngine):
    """The local OpenVINO engine. See the module docstring for a call."""

    backend_tag = ""
    """Appended to the fingerprint: KV computed by another backend's kernels is close to, not
    equal to, this one's, so snapshots do not cross backends (a resume re-prefills instead)."""

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
        tokenizer = OVTokenizer(self.files.ir_dir)
        requested_kv = kv_cache_precision or ("f32" if exact else DEFAULT_KV_PRECISION)
        config: dict[str, str] = {"CACHE_DIR": str(compiled_cache_dir())}
        config.update(EXACT_CONFIG if exact else {})
        config["KV_CACHE_PRECISION"] = requested_kv
        config.update(ov_config or {})
        backend = self._open_backend(device, config, num_slots, slice_logits=slice_logits)
        self.numerics = backend.numerics
        """What the plugin computes in on this machine (read back, not what was asked)."""
        self.kv_cache_precision: str = self.numerics.kv_cache
        self.num_layers = backend.num_layers
        self._vocab_size = backend.vocab_size
        self._constraints: ConstraintFactory | None = None
        super().__init__(
            slots=backend.slots, tokenizer=tokenizer,
            fingerprint=_fingerprint(self.files.model_xml, self.kv_cache_precision, device) + self.backend_tag,
            eos_token_ids={tokenizer.eos_token_id},
            max_context_len=max_context_len or _context_length(self.files) or DEFAULT_CONTEXT_LEN,
            kv_bytes_per_token=(2 * backend.num_layers * backend.heads * backend.head_dim
                                * _BYTES.get(self.kv_cache_precision, 4)),
            restores_exact=self.numerics.restores_exact, prefill_chunk_size=prefill_chunk_size,
            snapshot_precision=snapshot_precision, prefix_cache_bytes=prefix_cache_bytes,
            prefix_cache_precision=prefix_cache_precision, offload_bytes=offload_bytes, spill_dir=spill_dir,
        )

    def _open_backend(self, device: str, config: dict[str, str], num_slots: int, *, slice_logits: bool) -> Backend:
        """Compile the stateful model; each InferRequest is one KV slot."""
        core = ov.Core()
        ov_model = core.read_model(str(self.files.model_xml))
        if slice_logits:
            slice_last_position(ov_model)
        compiled = compile_for_device(core, ov_model, device, config)
        inputs = frozenset(name for i in ov_model.inputs for name in i.get_names())
        slots = [StatefulSlot(compiled.create_infer_request(), i, inputs) for i in range(num_slots)]
        heads, head_dim = _state_head_shape(slots[0])
        return Backend(
            slots=slots, numerics=PluginNumerics.of(compiled, config["KV_CACHE_PRECISION"]),
            num_layers=slots[0].layout.num_layers, heads=heads, head_dim=head_dim,
            vocab_size=int(ov_model.output("logits").get_partial_shape()[2].get_length()),
        )

    @property
    def tokenizer(self) -> OVTokenizer:
        return self._tokenizer  # type: ignore[no-any-return]

    def _rope_reference(self) -> tuple[tuple[float, float] | None, float]:
        """θ from the model's GGUF / config.json metadata; the floor of this KV precision."""
        metadata = rope_metadata(self.files.config(), self.files.gguf_metadata())
        return metadata, FIT_TOLERANCE.get(self.kv_cache_precision, max(FIT_TOLERANCE.values()))

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
            from agentkv.engine.decode.constraints import ConstraintFactory

            self._constraints = ConstraintFactory(
                meta["tokenizer.ggml.tokens"],
                eos_token_id=sorted(self.eos_token_ids),
                vocab_size=self._vocab_size,
                token_types=meta.get("tokenizer.ggml.token_type"),
                encode=self.tokenizer.encode,
            )
        return self._constraints(grammar)


def _state_head_shape(slot: StatefulSlot) -> tuple[int, int]:
    """(heads, head_dim) of the KV states, read from a fresh request's ``[0, H, 0, D]`` state."""
    shape = slot.request.query_state()[0].state.shape
    return int(shape[1]), int(shape[3])


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
