"""Building the paged model's compiled graphs: the IR made paged, compiled once per kind of step, in parallel.

``paged_attention_transformation`` rewrites each attention of a stateful IR into OpenVINO's
PagedAttention op; the KV caches become ``key_cache.N`` / ``value_cache.N`` inputs of
``[num_blocks, heads, BLOCK_SIZE, head_dim]`` (typed here), and a gather before the LM head keeps
only the positions a step asks for (``logits_indices``). The result is compiled for up to three
kinds of step, each its own compilation of the same model over the same KV blocks::

    compiling = compile_graphs(ov.Core(), files, "CPU", {"KV_CACHE_PRECISION": "f16"}, ov.Type.f16, extra=2)
    (decode,) = compiling.decode.compiled     # returned as soon as it is compiled
    decode, chunk, small = compiling.whole.result().compiled  # fewer when ``extra`` is lower or a compile failed

- **decode**: one token per sequence (with ``next_token``, each row's argmax);
- **chunk**: every other step (prefill chunks, verifies of full drafts, forced chunks);
- **small**: steps of one sequence feeding at most ``SMALL_STEP_TOKENS`` tokens (a small draft's
  verify).

Why several: the CPU plugin re-prepares a graph whenever its input shapes change, and that costs
15–25 ms beside a ~25 ms one-token step of the default model on 2 cores, even for 13 → 12 tokens
(measured, issue 27). A graph per kind of step keeps each graph's shapes: quoting, whose drafts
alternate 13- and 4-token verifies, went from 1.89× to 2.02× plain decoding with the small graph.

The compiles run in parallel threads, at least two at a time: each is mostly one thread (2 cores:
two graphs in 4.0 s instead of 7.4, three in 5–6 s). The caller waits for the decode graph only (what
a model needs to run every step, slower after each change of shape) and takes the others as they
come: an engine opens ~2 s sooner. Without ``CACHE_DIR``: these graphs cannot be
cached anyway (OpenVINO 2026.4 drops the PagedAttention ops' head sizes from a compiled blob, so
importing one fails and the plugin compiles again, after hashing the whole model first), and the
cache's hashing switches the process to the C locale for a while, which overlapping compiles can
leave behind (measured: with ``CACHE_DIR``, a thread polling during three parallel compiles saw
ASCII as the preferred encoding ~11 % of the time; without it, never).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import openvino as ov

from agentkv.engine.openvino.compile import compile_for_device, lm_head
from agentkv.engine.openvino.models import ModelFiles
from agentkv.engine.openvino.numerics import precision_name
from agentkv.engine.paged.block_pool import BLOCK_SIZE
from agentkv.engine.paged.compiled_pool import HeldGraphs, finished
from agentkv.errors import PagedFormUnsupported

SMALL_STEP_TOKENS = 4
"""The most tokens a step of one sequence feeds to run on the small graph: a small draft's verify
(``prompt_lookup.SMALL_DRAFT`` + 1 pending token)."""
GRAPH_NAMES = ("decode", "chunk", "small")
"""The graphs in the order ``compile_graphs`` returns them (each compiled model's friendly name
ends with its kind: ``SmolLM2 (chunk steps)``)."""
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CompilingGraphs:
    """A paged model's graphs as ``compile_graphs`` returns them: the decode graph, compiled, and
    the whole set still compiling in the background."""

    decode: HeldGraphs
    """The decode graph alone."""
    whole: Future[HeldGraphs]
    """Every graph that compiled, the decode graph first (the same object): a failed extra graph
    and those after it are left out, with a warning (their steps run on the graph before them)."""


def compile_graphs(core: ov.Core, files: ModelFiles, device: str, config: dict[str, str], element: ov.Type,
                   extra: int) -> CompilingGraphs:
    """Read the stateful IR, make it paged (typed caches, positions gathered before the LM head)
    and compile the decode graph and ``extra`` (0–2) more, in parallel; return once the decode
    graph is compiled (its failure raises here), the others still compiling."""
    model = core.read_model(str(files.model_xml))
    from openvino._offline_transformations import paged_attention_transformation

    heads, head_dim = _state_kv_shape(model)
    paged_attention_transformation(model, False, False, False, False, False)
    num_layers = _type_caches(model, element, (heads, head_dim))
    _gather_positions(model)
    models = [model] + [model.clone() for _ in range(extra)]  # NOTE: no ``next_token``: their rows are read anyway
    add_next_token(model)
    name = model.get_friendly_name()
    for kind, each in zip(GRAPH_NAMES, models):
        each.set_friendly_name(f"{name} ({kind} steps)")
    config = {key: value for key, value in config.items() if key != "CACHE_DIR"}
    # NOTE: two at a time at least: the decode graph then shares the cores with one other compile,
    # not two (the default model on 2 cores: an engine opens in 4.4 s, mean of seven, against 6.6 s
    # when it waited for three compiled at once)
    pool = ThreadPoolExecutor(min(len(models), max(2, os.cpu_count() or 2)), thread_name_prefix="agentkv-compile")
    futures = [pool.submit(compile_for_device, core, each, device, config) for each in models]

    def collect() -> HeldGraphs:  # NOTE: submitted last, so it waits on compiles that are running
        compiled = [futures[0].result()]
        for kind, future in zip(GRAPH_NAMES[1:], futures[1:]):
            try:
                compiled.append(future.result())
            except Exception:
                logger.warning("compiling the paged model's %s graph failed: its steps run on the %s graph "
                               "(correct, slower after each shape change)", kind, GRAPH_NAMES[len(compiled) - 1],
                               exc_info=True)
                break
        return HeldGraphs(tuple(compiled), heads, head_dim, num_layers)

    try:
        decode = HeldGraphs((futures[0].result(),), heads, head_dim, num_layers)
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    whole = pool.submit(collect) if extra else finished(decode)
    pool.shutdown(wait=False)
    return CompilingGraphs(decode, whole)


def compute_precision(core: ov.Core, device: str, config: dict[str, str]) -> str:
    """The plugin's compute precision for ``config`` (its hint, else the device's default)."""
    hint = config.get("INFERENCE_PRECISION_HINT")
    if hint is None:
        try:
            hint = core.get_property(device, "INFERENCE_PRECISION_HINT")
        except RuntimeError:
            return "f32"
    return precision_name(hint)


def _type_caches(model: ov.Model, element: ov.Type, row: tuple[int, int]) -> int:
    """Give every cache input its element type and ``[?, heads, BLOCK_SIZE, head_dim]`` shape
    (a u8 cache's compiled shape adds its parameters); return the number of layers."""
    layers = 0
    for param in model.get_parameters():
        name = param.get_output_tensor(0).get_any_name()
        if name.startswith(("key_cache.", "value_cache.")):
            layers += name.startswith("key_cache.")
            param.set_element_type(element)
            param.set_partial_shape(ov.PartialShape([-1, row[0], BLOCK_SIZE, row[1]]))
    model.validate_nodes_and_infer_types()
    return layers


def _state_kv_shape(model: ov.Model) -> tuple[int, int]:
    """(KV heads, head_dim) from the stateful IR's KV states ``[batch, heads, T, head_dim]``
    (read before the transformation replaces them)."""
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            shape = op.get_output_partial_shape(0)
            if shape.rank.get_length() == 4 and shape[1].is_static and shape[3].is_static:
                return shape[1].get_length(), shape[3].get_length()
    raise PagedFormUnsupported("the model has no [batch, heads, T, head_dim] KV states: export a stateful "
                               "LLM IR (optimum-intel, or openvino-genai's GGUF conversion)")


def _gather_positions(model: ov.Model) -> None:
    """Insert ``hidden[logits_indices]`` before the LM head MatMul (behind any elementwise tail:
    ``compile.lm_head``), ``logits_indices`` a new ``i64 [rows]`` input: the flat positions whose
    logits ``step`` returns (each sequence's last one, or all of them)."""
    import openvino.opset13 as ops

    matmul = lm_head(model)
    if matmul is None:
        raise PagedFormUnsupported("the model's logits do not come from a MatMul through elementwise ops "
                                   "only; cannot keep only the last positions")
    indices = ops.parameter(ov.PartialShape([-1]), ov.Type.i64, name="logits_indices")
    indices.output(0).get_tensor().set_names({"logits_indices"})
    hidden = ops.gather(matmul.input_value(0), indices, np.array(0, np.int64))
    matmul.input(0).replace_source_output(hidden.output(0))
    model.add_parameters([indices])
    model.validate_nodes_and_infer_types()


def add_next_token(model: ov.Model) -> None:
    """Add an output ``next_token``, each returned row's argmax as numpy's (the lowest id whose logit
    equals the row's max): a greedy run reads one number, not the row (it arrives cold: ~0.08 ms).
    These reductions cost 0.2 ms for 1 row of 49,152, 0.5 for 8; a stable TopK 0.7, 17 (it sorts)."""
    import openvino.opset13 as ops

    logits = next(o for o in model.outputs if "logits" in o.get_names()).get_node().input_value(0)
    vocab = logits.get_partial_shape()[-1].get_length()
    axis, ids = np.array([-1], np.int64), ops.constant(np.arange(vocab, dtype=np.int64))
    is_max = ops.equal(logits, ops.reduce_max(logits, axis, keep_dims=True))
    result = ops.result(ops.reduce_min(ops.select(is_max, ids, np.array(vocab, np.int64)), axis, keep_dims=True))
    result.output(0).get_tensor().set_names({"next_token"})
    model.add_results([result])
    model.validate_nodes_and_infer_types()
