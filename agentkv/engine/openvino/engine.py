"""OpenVINOEngine: the parent both OpenVINO backends share — model, tokenizer, compile options, numerics.

It resolves the model (the default one, a GGUF converted to IR, or an IR directory), opens its
tokenizer, merges the compile options (``exact``, KV precision, ``ov_config``), reads back what
the plugin computes in (``numerics``), fingerprints model + KV layout + device, and builds grammar
constraints from the model's vocabulary. A subclass compiles its form of the model into KV slots
(``_compile``) and may bring its own backend (``_make_backend``): ``StatefulEngine`` (an
InferRequest per slot) and ``PagedEngine`` (block tables over a shared pool) are siblings::

    class MyEngine(OpenVINOEngine):
        def _compile(self, device, config, num_slots):
            return CompiledSlots(slots=[...], numerics=..., num_layers=30, vocab_size=49152,
                                 kv_bytes_per_token=46_080)
"""

from __future__ import annotations

import abc
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from agentkv.engine.openvino.models import ModelFiles, compiled_cache_dir, resolve_model
from agentkv.engine.openvino.numerics import EXACT_CONFIG, PluginNumerics
from agentkv.engine.openvino.tokenizer import OVTokenizer
from agentkv.engine.session.backend import RopeReference, SlotBackend
from agentkv.engine.session.slot_engine import SlotEngine
from agentkv.errors import ConstraintError, UserError
from agentkv.kv.log import KVSlot
from agentkv.kv.rope import FIT_TOLERANCE, rope_metadata
from agentkv.kv.snapshot import PrecisionChoice

if TYPE_CHECKING:
    from agentkv.engine.decode.constraints import ConstraintFactory, GrammarConstraint

KVPrecision = Literal["u8", "f16", "bf16", "f32"]
KV_BYTES = {"u8": 1, "f16": 2, "bf16": 2, "f32": 4}
"""Bytes of one cached K or V element, by KV cache precision."""
DEFAULT_KV_PRECISION: KVPrecision = "f16"
"""The smallest KV cache whose restores are bit-exact (see ``engine/stateful/engine.py``)."""
DEFAULT_CONTEXT_LEN = 8192
DEFAULT_PREFIX_CACHE_BYTES = 256 << 20
DEFAULT_OFFLOAD_BYTES = 2 << 30


@dataclass(frozen=True)
class CompiledSlots:
    """What compiling one form of the model gives its engine: the KV slots and the model's shape."""

    slots: Sequence[KVSlot]
    numerics: PluginNumerics
    """What the plugin computes in (read back from the compiled model)."""
    num_layers: int
    vocab_size: int
    kv_bytes_per_token: int
    """Bytes one token's K and V take in this form's cache (all layers)."""


class OpenVINOEngine(SlotEngine, abc.ABC):
    """A local OpenVINO model served as KV slots; ``StatefulEngine`` and ``PagedEngine`` compile it."""

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
        if kv_cache_precision is not None and kv_cache_precision not in KV_BYTES:
            raise UserError(f"kv_cache_precision must be one of u8, f16, bf16, f32, got {kv_cache_precision!r}")
        if exact and kv_cache_precision not in (None, "f32"):
            raise UserError(f"exact=True needs an f32 KV cache, got kv_cache_precision={kv_cache_precision!r}; "
                            "drop one of the two")
        self.files: ModelFiles = resolve_model(model)
        self._ov_tokenizer = OVTokenizer(self.files.ir_dir)
        config: dict[str, str] = {"CACHE_DIR": str(compiled_cache_dir())}
        config.update(EXACT_CONFIG if exact else {})
        config["KV_CACHE_PRECISION"] = kv_cache_precision or ("f32" if exact else DEFAULT_KV_PRECISION)
        config.update(ov_config or {})
        compiled = self._compile(device, config, num_slots)
        self.numerics = compiled.numerics
        """What the plugin computes in on this machine (read back, not what was asked)."""
        self.kv_cache_precision: str = self.numerics.kv_cache
        self.num_layers = compiled.num_layers
        self._vocab_size = compiled.vocab_size
        self._constraints: ConstraintFactory | None = None
        super().__init__(self._make_backend(
            slots=compiled.slots, tokenizer=self._ov_tokenizer,
            fingerprint=_fingerprint(self.files.model_xml, self.kv_cache_precision, device) + self._fingerprint_tag(),
            eos_token_ids={self._ov_tokenizer.eos_token_id, *self.files.generation_eos_ids()},
            max_context_len=max_context_len or _context_length(self.files) or DEFAULT_CONTEXT_LEN,
            kv_bytes_per_token=compiled.kv_bytes_per_token, restores_exact=self.numerics.restores_exact,
            prefill_chunk_size=prefill_chunk_size, snapshot_precision=snapshot_precision,
            prefix_cache_bytes=prefix_cache_bytes, prefix_cache_precision=prefix_cache_precision,
            offload_bytes=offload_bytes, spill_dir=spill_dir, rope_reference=self._rope_reference,
        ))

    @abc.abstractmethod
    def _compile(self, device: str, config: dict[str, str], num_slots: int) -> CompiledSlots:
        """Compile this engine's form of ``self.files`` with ``config`` into ``num_slots`` KV slots."""

    def _make_backend(self, **options: Any) -> SlotBackend:
        """The backend its sessions work through (``options``: as ``SlotBackend``)."""
        return SlotBackend(**options)

    def _fingerprint_tag(self) -> str:
        """Appended to the fingerprint: KV computed by another backend's kernels is close to, not
        equal to, this one's, so snapshots do not cross backends (a resume re-prefills instead)."""
        return ""

    def _kv_layout(self) -> str:
        return "stateful"

    def _kv_precision(self) -> str:
        return self.kv_cache_precision

    def _numerics_class(self) -> str:
        return str(self.numerics)

    @property
    def tokenizer(self) -> OVTokenizer:
        return self._ov_tokenizer

    @property
    def exact(self) -> bool:
        """Whether this engine's numerics are exact (``numerics.exact``: f32 KV, f32 compute, no
        dynamic quantisation, as ``exact=True`` compiles): its KV then never depends on chunking,
        and what keeps it bit-exact is chosen by default (``Agent.past_reasoning="auto"``, the
        self-check's tolerance): ``open_engine(exact=True).exact`` → True."""
        return self.numerics.exact

    def _rope_reference(self) -> RopeReference:
        """RoPE from the model's config.json / GGUF metadata (θ, scaling, rotated dims, per-layer
        θ); the floor of this KV precision."""
        metadata = rope_metadata(self.files.config(), self.files.gguf_metadata())
        return metadata, FIT_TOLERANCE.get(self.kv_cache_precision, max(FIT_TOLERANCE.values()))

    def make_constraint(self, grammar: str) -> GrammarConstraint:
        """A fresh grammar constraint (llguidance Lark grammar) for one generation::

            c = engine.make_constraint(tool_call_grammar(agent.tool_schemas, "required"))
            await session.generate(ids, cfg, constraint=c)
        """
        if self._constraints is None:
            self._constraints = self._constraint_factory()
        return self._constraints(grammar)

    def _constraint_factory(self) -> ConstraintFactory:
        """llguidance's view of the vocabulary: the IR's ``tokenizer.json``, else its GGUF's."""
        from agentkv.engine.decode.constraints import ConstraintFactory

        eos = sorted(self.eos_token_ids)
        tokenizer_json = self.files.tokenizer_json()
        if tokenizer_json is not None:
            return ConstraintFactory.from_tokenizer_json(
                tokenizer_json, eos_token_id=eos, vocab_size=self._vocab_size, encode=self.tokenizer.encode
            )
        meta = self.files.gguf_metadata()
        if "tokenizer.ggml.tokens" in meta:
            return ConstraintFactory(
                meta["tokenizer.ggml.tokens"],
                eos_token_id=eos,
                vocab_size=self._vocab_size,
                token_types=meta.get("tokenizer.ggml.token_type"),
                encode=self.tokenizer.encode,
                tokenizer_model=meta.get("tokenizer.ggml.model"),
            )
        raise ConstraintError(
            f"grammar-constrained decoding needs the model's vocabulary, and {self.files.ir_dir} has "
            "neither tokenizer.json nor a .gguf; copy the model's tokenizer.json (from its Hugging Face "
            "repo) next to openvino_model.xml, or set Agent(constrain_tool_calls=False)"
        )


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
