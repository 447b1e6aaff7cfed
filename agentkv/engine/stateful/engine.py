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
only close is listed in ``engine/openvino/numerics.py``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import openvino as ov

from agentkv.engine.openvino.compile import compile_for_device, lm_head
from agentkv.engine.openvino.engine import KV_BYTES, CompiledSlots, OpenVINOEngine
from agentkv.engine.openvino.numerics import PluginNumerics
from agentkv.engine.stateful.slot import StatefulSlot


def slice_last_position(model: ov.Model) -> bool:
    """Insert ``hidden[:, -1:, :]`` before the LM head MatMul so logits cover the last position.

    Returns False (model unchanged) when the logits do not come from a MatMul through elementwise
    ops only (``compile.lm_head``; Gemma 2's softcap is such a tail).
    """
    import openvino.opset13 as ops

    matmul = lm_head(model)
    if matmul is None:
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


class StatefulEngine(OpenVINOEngine):
    """The local OpenVINO engine on the stateful model. See the module docstring for a call."""

    def __init__(self, model: str | os.PathLike[str] | None = None, *, slice_logits: bool = True,
                 **options: Any) -> None:
        """``slice_logits=False`` keeps the logits of every position (for measuring the gain);
        ``options`` as ``OpenVINOEngine`` (device, kv_cache_precision, exact, num_slots, …)."""
        self._slice_logits = slice_logits
        super().__init__(model, **options)

    def _compile(self, device: str, config: dict[str, str], num_slots: int) -> CompiledSlots:
        """Compile the stateful model; each InferRequest is one KV slot."""
        core = ov.Core()
        ov_model = core.read_model(str(self.files.model_xml))
        if self._slice_logits:
            slice_last_position(ov_model)
        compiled = compile_for_device(core, ov_model, device, config)
        inputs = frozenset(name for i in ov_model.inputs for name in i.get_names())
        slots = [StatefulSlot(compiled.create_infer_request(), i, inputs) for i in range(num_slots)]
        self._slots = slots
        heads, head_dim = _state_head_shape(slots[0])
        numerics = PluginNumerics.of(compiled, config["KV_CACHE_PRECISION"])
        layers = slots[0].layout.num_layers
        return CompiledSlots(
            slots=slots, numerics=numerics, num_layers=layers,
            vocab_size=int(ov_model.output("logits").get_partial_shape()[2].get_length()),
            kv_bytes_per_token=2 * layers * heads * head_dim * KV_BYTES.get(numerics.kv_cache, 4),
        )


    def _model_steps(self) -> int:
        """Forward passes of every slot's InferRequest (each ``feed`` is one)."""
        return sum(slot.forward_passes for slot in self._slots)


def _state_head_shape(slot: StatefulSlot) -> tuple[int, int]:
    """(heads, head_dim) of the KV states, read from a fresh request's ``[0, H, 0, D]`` state."""
    shape = slot.request.query_state()[0].state.shape
    return int(shape[1]), int(shape[3])
