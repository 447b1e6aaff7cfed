"""The PagedAttention form of a model: compiled once or twice, caller-owned KV blocks, a step over many sequences.

``openvino._offline_transformations.paged_attention_transformation`` rewrites each attention of
the IR into OpenVINO's PagedAttention op. The KV then lives in ``key_cache.N`` / ``value_cache.N``
tensors of ``[num_blocks, heads, BLOCK_SIZE, head_dim]`` that this class allocates once; which
blocks a sequence reads and writes is its block table. One ``step`` runs any number of
sequences, each feeding its new tokens after ``past_len`` cached ones::

    model = PagedModel(resolve_model(None), num_blocks=256)
    logits = model.step([SequenceStep(ids=prompt, past_len=0, blocks=[0, 1, 2, 3])])  # [1, vocab]

A gather before the LM head keeps only each sequence's last position (prefill needs no more), or
the last ``last_rows`` positions of a sequence that asks for more (a verified draft).
Blocking and thread-safe: ``lock`` serialises steps and access to the block storage (one
InferRequest serves every sequence of a step). No sessions, no messages here.

Up to three compiled graphs of the same model over the same KV blocks (``graphs.py``): one for
steps where every sequence feeds one token (decoding), one for a sequence's small steps (≤
``SMALL_STEP_TOKENS`` tokens: a small draft's verify), one for the rest (prefill chunks, full
drafts' verifies, forced chunks). The CPU plugin re-prepares a graph whenever its input shapes
change, 15–25 ms beside a ~25 ms decode step of the default model on 2 cores (measured, issue 27):
a graph per kind of step keeps each one's shapes. Same logits, bit for bit, on any of them. A model
steps as soon as its decode graph is compiled; the others take their steps as they come
(``wait_for_graphs``).

OpenVINO's compiled-blob cache (``CACHE_DIR``) cannot hold these graphs, so models share them
(``compiled_pool.py``): a model on the files and settings of a live one runs on its compiled graphs
(its own infer requests, its own KV blocks) and compiles nothing; ``release()`` (what closing an
engine does) lets them go, to the next model on the same files and settings when the last user
releases them and ``AGENTKV_KEEP_COMPILED`` allows.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import openvino as ov

from agentkv.engine.openvino.models import ModelFiles
from agentkv.engine.openvino.numerics import EXACT_CONFIG, PluginNumerics
from agentkv.engine.paged.compiled_pool import COMPILED, GraphKey, GraphLease, HeldGraphs, keep_limit
from agentkv.engine.paged.block_precision import block_precision
from agentkv.engine.paged.block_pool import BLOCK_SIZE
from agentkv.engine.paged.graphs import SMALL_STEP_TOKENS, compile_graphs
from agentkv.engine.paged.request_inputs import OneTokenRequest, StepRequest, padded_table
from agentkv.kv.u8_blocks import BlockLayout
from agentkv.errors import UserError

STEP_INPUTS: dict[str, type[np.generic]] = {
    "input_ids": np.int64, "position_ids": np.int64, "past_lens": np.int32, "subsequence_begins": np.int32,
    "block_indices": np.int32, "block_indices_begins": np.int32, "max_context_len": np.int32,
    "logits_indices": np.int64,
}
"""The paged model's step inputs (openvino's SDPA-to-PagedAttention names) and their element types."""
CHUNK_GRAPH_MAX_WEIGHTS = 1 << 30
"""``chunk_graph=None`` compiles the second graph on CPU when the weights file is at most this big:
it holds a second copy of the compiled weights (the default model's ``PagedModel``: 299 MB RSS with
one graph, 380–393 with two, 482–486 with three; two runs, an avx2 CPU), and the shape change it
saves costs the same milliseconds whatever the model's size, a smaller share of a larger model's
step. The cost was measured on the CPU plugin only."""
SMALL_GRAPH_MAX_WEIGHTS = 256 << 20
"""``small_graph=None`` compiles the small-step graph (with the chunk graph) on CPU when the weights
file is at most this big: a third copy of the compiled weights (the default model: +89–106 MB RSS),
for +6 % on quoting there (+6.5 % across separate runs, 1.89× → 2.02× plain decoding; +5.6 % and
+6.0 % with the graph swapped call by call in one process; an avx2 CPU)."""
__all__ = ["BLOCK_SIZE", "CHUNK_GRAPH_MAX_WEIGHTS", "SMALL_GRAPH_MAX_WEIGHTS", "SMALL_STEP_TOKENS", "STEP_INPUTS",
           "PagedModel", "SequenceStep", "lock_calling_first", "logit_rows"]
_CACHE_TYPES = {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16, "u8": ov.Type.u8}
"""Element type of the blocks per KV precision."""


@dataclass(frozen=True)
class SequenceStep:
    """One sequence's part of a step: feed ``ids`` after ``past_len`` cached tokens."""

    ids: Sequence[int]
    past_len: int
    blocks: Sequence[int]
    """Block table: block i holds positions ``i*BLOCK_SIZE .. (i+1)*BLOCK_SIZE-1``; it must cover
    ``past_len + len(ids)`` positions."""
    position_offset: int = 0
    """Added to every position id (how RoPE is measured: ``kv/rope.py``)."""
    last_rows: int = 1
    """Return the logits of this many last positions (>1: a prompt-lookup draft is verified so)."""


def logit_rows(sequences: Sequence[SequenceStep]) -> list[int]:
    """Rows of ``PagedModel.step``'s logits per sequence: its ``last_rows``, at most ``len(ids)``."""
    return [max(1, min(s.last_rows, len(s.ids))) for s in sequences]


class PagedModel:
    """The compiled paged model and its KV block storage. See the module docstring for a call."""

    def __init__(
        self,
        files: ModelFiles,
        *,
        num_blocks: int | None = None,
        kv_cache_bytes: int | None = None,
        device: str = "CPU",
        kv_cache_precision: str = "f16",
        exact: bool = False,
        ov_config: dict[str, str] | None = None,
        chunk_graph: bool | None = None,
        small_graph: bool | None = None,
    ) -> None:
        """``chunk_graph``: compile the model again for the steps that are not one token per
        sequence (see the module docstring); None: on CPU when the weights file is at most
        ``CHUNK_GRAPH_MAX_WEIGHTS``. ``small_graph`` (True needs the chunk graph: ``UserError``
        without it): a third compile for one sequence's steps of at most ``SMALL_STEP_TOKENS``
        tokens; None: on CPU when the weights file is at most ``SMALL_GRAPH_MAX_WEIGHTS``."""
        if (num_blocks is None) == (kv_cache_bytes is None):
            raise UserError("give PagedModel either num_blocks or kv_cache_bytes")
        if kv_cache_precision not in _CACHE_TYPES:
            raise UserError(f"kv_cache_precision must be one of {sorted(_CACHE_TYPES)}, got {kv_cache_precision!r}")
        if exact and kv_cache_precision != "f32":
            raise UserError("exact=True needs kv_cache_precision='f32'")
        core = ov.Core()
        config = {**(EXACT_CONFIG if exact else {}), "KV_CACHE_PRECISION": kv_cache_precision, **(ov_config or {})}
        kv_cache_precision = block_precision(kv_cache_precision, core, device, config)
        element = _CACHE_TYPES[kv_cache_precision]
        weights = files.model_xml.with_suffix(".bin")
        size = weights.stat().st_size if weights.is_file() else 0
        on_cpu = device.upper() == "CPU"
        if chunk_graph is None:
            chunk_graph = on_cpu and size <= CHUNK_GRAPH_MAX_WEIGHTS
        if small_graph and not chunk_graph:
            raise UserError("small_graph=True needs the chunk graph: pass chunk_graph=True too (the small graph "
                            "takes some of the steps the chunk graph runs)")
        if small_graph is None:
            small_graph = chunk_graph and on_cpu and size <= SMALL_GRAPH_MAX_WEIGHTS
        extra = chunk_graph + small_graph
        key = GraphKey.of(files, device, config, kv_cache_precision, graphs=1 + extra)
        keep_limit()  # NOTE: a bad AGENTKV_KEEP_COMPILED is refused before anything compiles

        def compile_now() -> tuple[HeldGraphs, Future[HeldGraphs]]:
            compiling = compile_graphs(core, files, device, config, element, extra)
            return compiling.decode, compiling.whole

        # NOTE: an engine dropped without aclose() holds its lease until collected: a model on its
        # key shares its graphs meanwhile, as it would a live engine's
        lease = COMPILED.share(key, compile_now)
        self.graph_key = key
        """What the compiled graphs depend on: models with the same key share them (``COMPILED.users(key)``)."""
        self._lease = lease
        self._let_go = weakref.finalize(self, lease.release, collecting=True)
        """Releases the lease if this model is collected without ``release()``."""
        self._let_go.atexit = False
        try:
            self._open(lease, num_blocks, kv_cache_bytes, kv_cache_precision, element)
        except BaseException:
            self._let_go.detach()
            lease.release()
            raise

    def _open(self, lease: GraphLease, num_blocks: int | None, kv_cache_bytes: int | None, kv_cache_precision: str,
              element: ov.Type) -> None:
        """The rest of ``__init__``: the block storage and requests over the lease's graphs."""
        held, whole = lease.decode, lease.whole
        self._held: HeldGraphs | None = held
        """The graphs running steps: the decode graph first, the others once compiled; None once released."""
        self._whole = whole
        self._graphs_in = threading.Event()
        """Set once every graph this model will have runs steps (or it was released)."""
        self.heads, self.head_dim, self.num_layers = held.heads, held.head_dim, held.num_layers
        compiled = held.compiled[0]
        # NOTE: the plugin chooses a u8 cache's block shapes (its quantisation parameters live in
        # the blocks, by channel or by token): read them from the compiled model.
        cache_ports = {port.get_any_name(): port for port in compiled.inputs
                       if port.get_any_name().startswith(("key_cache.", "value_cache."))}
        shapes = {name: tuple(d.get_length() for d in list(port.get_partial_shape())[1:])
                  for name, port in cache_ports.items()}
        self.block_shapes = (shapes["key_cache.0"], shapes["value_cache.0"])
        """``[heads, rows, cols]`` of one key block and one value block (as the plugin laid them out)."""
        self.block_bytes = self.num_layers * element.size * sum(int(np.prod(s)) for s in self.block_shapes)
        """Bytes of one block across every layer's K and V."""
        if kv_cache_precision == "u8":  # refuse a layout the numpy codec does not know, now
            for shape in self.block_shapes:
                BlockLayout.of(shape, block_tokens=BLOCK_SIZE, head_dim=self.head_dim)
        if num_blocks is None:
            assert kv_cache_bytes is not None
            num_blocks = kv_cache_bytes // self.block_bytes
        if num_blocks < 1:
            raise UserError(f"the KV cache needs at least one block; got num_blocks={num_blocks} "
                            f"(kv_cache_bytes={kv_cache_bytes})")
        self.numerics = replace(PluginNumerics.of(compiled, kv_cache_precision), kv_cache=kv_cache_precision)
        self.kv_cache_precision = kv_cache_precision
        """The blocks' element type: "f32", "f16", "bf16" (f16 asked, bf16 compute) or "u8"."""
        self.num_blocks = num_blocks
        self.vocab_size = int(compiled.output("logits").get_partial_shape()[2].get_length())
        self.lock = threading.RLock()
        """Held by every step and every read or write of the block storage."""
        self.steps_run = 0
        """Forward passes run so far (batched steps, beam steps, RoPE probes)."""
        self.caches: dict[str, ov.Tensor] = {}
        """``key_cache.N`` / ``value_cache.N`` → the block storage (read and written through ``.data``)."""
        for name, port in cache_ports.items():
            tensor = ov.Tensor(port.get_element_type(), [num_blocks, *shapes[name]])
            tensor.data[...] = 0
            self.caches[name] = tensor
        self._decode_request = StepRequest(compiled, self.caches, STEP_INPUTS)
        """Runs the steps where every sequence feeds one token."""
        self._chunk_request = self._decode_request
        """Runs the other steps: the chunk graph's request once it joins (``_take_graphs``), the decode
        one until then or when there is none."""
        self._small_request = self._decode_request
        """Runs one sequence's steps of 2 to ``SMALL_STEP_TOKENS`` tokens: the small graph's request
        once it joins, or the chunk one (or the decode one) when there is none."""
        self._alone_request = OneTokenRequest(compiled, self.caches, STEP_INPUTS, block_size=BLOCK_SIZE)
        """Runs ``step_alone``: a third request of the decode graph, whose inputs only it writes."""
        whole.add_done_callback(partial(_graphs_compiled, weakref.ref(self)))

    def _take_graphs(self, whole: Future[HeldGraphs]) -> None:
        """Run steps on the graphs after the decode graph: called once, on the thread that compiled
        the last of them, or at once when there is nothing left to compile."""
        try:
            with self.lock:
                if self._held is not None and not whole.exception():
                    held = whole.result()
                    requests = [self._decode_request, *(StepRequest(graph, self.caches, STEP_INPUTS)
                                                        for graph in held.compiled[1:])]
                    self._chunk_request = requests[min(1, len(requests) - 1)]
                    self._small_request = requests[-1]
                    self._held = held
        finally:
            self._graphs_in.set()

    def wait_for_graphs(self, timeout: float | None = None) -> int:
        """Wait until the graphs still compiling run steps (at most ``timeout`` seconds); return
        ``graphs``. A model steps before that, on the graphs it has::

            model.wait_for_graphs()   # 3: before a benchmark, or to count them
        """
        self._graphs_in.wait(timeout)
        return self.graphs

    def release(self) -> None:
        """Drop the KV blocks and the lease on the compiled graphs (``compiled_pool``: other live
        models on the same files and settings keep running on them; after the last, the next model
        takes them when ``AGENTKV_KEEP_COMPILED`` allows); a step after it raises ``UserError``.
        What closing an engine does: ``model.release()``. Graphs still compiling are waited for
        (seconds, only right after the model was made), so the next model finds them."""
        with self.lock:
            if self._held is None:
                return
            self._held = None
            self.caches = {}
            del self._decode_request, self._chunk_request, self._small_request, self._alone_request
        self._graphs_in.set()
        wait([self._whole])
        self._let_go.detach()
        self._lease.release()

    def _check_held(self) -> None:
        """Raise ``UserError`` once the model is released (``lock`` held)."""
        if self._held is None:
            raise UserError("this paged model was released (its engine was closed): open a new engine")

    @property
    def graphs(self) -> int:
        """Compiled graphs running steps: 3 with a chunk and a small graph, 2 with a chunk graph
        only, 1 with neither (off, still compiling: ``wait_for_graphs``, or their compile failed),
        0 once released."""
        return 0 if self._held is None else len(self._held.compiled)

    def step(self, sequences: Sequence[SequenceStep]) -> np.ndarray:
        """Feed every sequence its ids; float32 logits ``[sum(logit_rows(sequences)), vocab]``: each
        sequence's last ``last_rows`` positions (usually 1), in order. Writes the new tokens' KV into
        their blocks."""
        if not sequences or any(not s.ids for s in sequences):
            raise UserError("step() needs at least one sequence, each with at least one id")
        begins, block_begins = [0], [0]
        ids: list[int] = []
        positions: list[int] = []
        blocks: list[int] = []
        rows: list[int] = []  # the flat positions whose logits are returned
        for seq, kept in zip(sequences, logit_rows(sequences)):
            total = seq.past_len + len(seq.ids)
            needed = -(-total // BLOCK_SIZE)
            if len(seq.blocks) < needed:
                raise UserError(f"a sequence of {total} tokens needs {needed} blocks, its table has {len(seq.blocks)}")
            rows.extend(range(len(ids) + len(seq.ids) - kept, len(ids) + len(seq.ids)))
            ids.extend(int(t) for t in seq.ids)
            positions.extend(range(seq.past_len + seq.position_offset, total + seq.position_offset))
            blocks.extend(int(b) for b in seq.blocks[:needed])
            begins.append(len(ids))
            block_begins.append(len(blocks))
        with self.lock:
            self._check_held()
            self.steps_run += 1
            return self._infer(ids, positions, sequences, begins, blocks, block_begins, rows)

    def step_alone(self, token: int, past_len: int, blocks: list[int], *,
                   while_running: Callable[[], None] | None = None) -> tuple[int, np.ndarray]:
        """``step`` of one sequence feeding one token (the table covering ``past_len + 1`` positions):
        the greedy next token (the graph's own argmax) and the float32 logits ``[vocab]``, an array
        the next ``step_alone`` overwrites (copy what you keep), on a request of the decode graph of
        its own (``OneTokenRequest``): how a run steps alone (``PagedSlot.feed_run``).
        ``while_running()`` runs while the step computes (lock held: it must not block), or before
        waiting for a lock another thread holds (``lock_calling_first``)::

            greedy, row = model.step_alone(42, past_len=130, blocks=table)
        """
        if len(blocks) * BLOCK_SIZE <= past_len:
            raise UserError(f"a sequence of {past_len + 1} tokens needs {past_len // BLOCK_SIZE + 1} blocks, "
                            f"its table has {len(blocks)}")
        while_running = lock_calling_first(self.lock, while_running)
        try:
            self._check_held()
            self.steps_run += 1
            greedy = self._alone_request.step(token, past_len, blocks, while_running)
            return greedy, self._alone_request.logits
        finally:
            self.lock.release()

    def _infer(self, ids: list[int], positions: list[int], sequences: Sequence[SequenceStep], begins: list[int],
               blocks: list[int], block_begins: list[int], rows: list[int]) -> np.ndarray:
        if len(ids) == len(sequences):
            request = self._decode_request
        elif len(sequences) == 1 and len(ids) <= SMALL_STEP_TOKENS:
            request = self._small_request
        else:
            request = self._chunk_request
        write = request.inputs.write
        write("input_ids", ids)
        write("position_ids", positions)
        write("past_lens", [s.past_len for s in sequences])
        write("subsequence_begins", begins)
        write("block_indices", padded_table(blocks))
        write("block_indices_begins", block_begins)
        write("max_context_len", max(s.past_len + len(s.ids) for s in sequences))
        write("logits_indices", rows)
        return request.infer()

    def copy_block(self, source: int, target: int) -> None:
        """Copy block ``source`` into block ``target`` in every layer's K and V (raw: any precision)."""
        with self.lock:
            self._check_held()
            for tensor in self.caches.values():
                data = tensor.data
                data[target] = data[source]

    def u8_layout(self, *, key: bool) -> BlockLayout:
        """How a u8 cache lays out its key (``key=True``) or value blocks."""
        return BlockLayout.of(self.block_shapes[0 if key else 1], block_tokens=BLOCK_SIZE, head_dim=self.head_dim)

    def cache_layers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per layer, numpy views ``(keys, values)`` of ``[num_blocks, *block_shapes[i]]``."""
        with self.lock:
            self._check_held()
        return [(self.caches[f"key_cache.{i}"].data, self.caches[f"value_cache.{i}"].data)
                for i in range(self.num_layers)]


def _graphs_compiled(model: weakref.ref[PagedModel], whole: Future[HeldGraphs]) -> None:
    """``PagedModel._take_graphs``, unless the model was collected first (the callback holds no model)."""
    alive = model()
    if alive is not None:
        alive._take_graphs(whole)


def lock_calling_first(lock: threading.RLock, first: Callable[[], None] | None) -> Callable[[], None] | None:
    """Take ``lock``, calling ``first()`` before waiting for it when another thread holds it; returns
    ``first`` if not called yet, else None (the caller releases ``lock``)::

        later = lock_calling_first(model.lock, post_deltas)      # then try: ... finally: release()
    """
    if first is not None:
        if lock.acquire(blocking=False):
            return first
        first()
    lock.acquire()
    return None
