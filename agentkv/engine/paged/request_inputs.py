"""StepRequest, StepInputs, OneTokenRequest: infer requests of the paged model, their step inputs written in place.

``InferRequest.infer(dict)`` dispatches every input through openvino's Python data helpers on
each call: 0.28 ms of Python per step for the paged model's eight inputs on a 2-core avx2 CPU,
measured (issue 27: more than the rest of a token's overhead). The request's input tensors stay
the same objects between steps, so this keeps a numpy view of each and copies the step's values
into it; a tensor is re-shaped (and its view taken again) only when its shape changes — for a
decoding sequence, when its block table grows. Same values, same infer::

    inputs = StepInputs(request, {"input_ids": np.int64, "max_context_len": np.int32})
    inputs.write("input_ids", [5]); inputs.write("max_context_len", 131)
    request.infer()

``StepRequest`` is such a request with the KV block tensors set once and its logits read without
openvino's own copy::

    graph = StepRequest(compiled, caches, STEP_INPUTS)
    graph.inputs.write("input_ids", [5]); ...
    logits = graph.infer()                     # float32 [rows, vocab], ours

``OneTokenRequest`` is a request of the decode graph that only ever steps one sequence by one
token (a greedy run, ``PagedSlot.feed_run``): its inputs keep their shapes, so a step writes four
numbers into views taken once (and the block table when it grew), and the logits land in an array
of ours set as the output once — nothing wrapped or copied around the infer::

    alone = OneTokenRequest(compiled, caches, STEP_INPUTS, block_size=32)
    greedy = alone.step(token, past_len=130, blocks=table)   # the graph's argmax
    alone.logits                                             # float32 [vocab], ours, overwritten by the next step
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import openvino as ov

class StepInputs:
    """The input tensors of one infer request, by name, each with its numpy element type."""

    def __init__(self, request: ov.InferRequest, dtypes: Mapping[str, type[np.generic]]) -> None:
        self._tensors = {name: request.get_tensor(name) for name in dtypes}
        self._dtypes = dict(dtypes)
        self._views: dict[str, np.ndarray] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}

    def write(self, name: str, values: Any) -> None:
        """Set input ``name`` to ``values`` (a sequence, or a scalar for a 0-d input)."""
        array = np.asarray(values, dtype=self._dtypes[name])
        if self._shapes.get(name) != array.shape:
            tensor = self._tensors[name]
            tensor.shape = list(array.shape)
            self._views[name] = tensor.data
            self._shapes[name] = array.shape
        self._views[name][...] = array


def request_over_blocks(compiled: ov.CompiledModel, caches: Mapping[str, ov.Tensor]) -> ov.InferRequest:
    """A new infer request of ``compiled`` stepping the KV block tensors ``caches`` (set once, shared
    with every other request over them): ``request = request_over_blocks(compiled, model.caches)``."""
    request = compiled.create_infer_request()
    for name, tensor in caches.items():
        request.set_tensor(name, tensor)
    return request


class StepRequest:
    """An infer request of a compiled paged model over the given KV block tensors (shared with any
    other request that steps the same blocks), with ``StepInputs`` for ``dtypes``."""

    def __init__(self, compiled: ov.CompiledModel, caches: Mapping[str, ov.Tensor],
                 dtypes: Mapping[str, type[np.generic]]) -> None:
        self.request = request_over_blocks(compiled, caches)
        self.inputs = StepInputs(self.request, dtypes)
        self._logits = next(i for i, port in enumerate(compiled.outputs) if "logits" in port.get_names())

    def infer(self) -> np.ndarray:
        """Run the step on the inputs written; float32 logits ``[rows, vocab]`` (a copy of ours)."""
        # NOTE: share_outputs: infer() would copy the logits into a new array only for the copy
        # below (measured: ~0.1 ms a token, a cold 196 KB copy). Setting an array of ours as the
        # output instead costs as much (set_output_tensor: ~40 us, and argmax then reads it cold).
        self.request.infer(share_outputs=True)
        out = self.request.get_output_tensor(self._logits).data  # [rows, 1, vocab] (by index: 4x faster)
        return np.array(out[:, -1, :], dtype=np.float32)


class OneTokenRequest:
    """An infer request of the decode graph for one sequence's one-token steps only (see the
    module docstring), over the given KV block tensors."""

    def __init__(self, compiled: ov.CompiledModel, caches: Mapping[str, ov.Tensor],
                 dtypes: Mapping[str, type[np.generic]], *, block_size: int) -> None:
        """``block_size``: positions per KV block (``model.BLOCK_SIZE``)."""
        self.request = request_over_blocks(compiled, caches)
        self._block_size = block_size
        self._inputs = StepInputs(self.request, dtypes)
        for name, value in (("input_ids", [0]), ("position_ids", [0]), ("past_lens", [0]), ("max_context_len", 1),
                            ("subsequence_begins", [0, 1]), ("logits_indices", [0])):
            self._inputs.write(name, value)
        views = self._inputs._views  # noqa: SLF001 - the same module's class; shapes never change here
        # NOTE: memoryviews, not numpy indexing: the Python right after an infer runs with cold
        # caches, where a numpy scalar read or write costs ~25 us and a memoryview's ~10 (measured)
        self._ids, self._positions, self._past, self._context = (
            _flat(views[name]) for name in ("input_ids", "position_ids", "past_lens", "max_context_len"))
        self._table: list[int] = []
        ports = {name: (i, port) for i, port in enumerate(compiled.outputs) for name in port.get_names()}
        vocab = ports["logits"][1].get_partial_shape()[2].get_length()
        self._logits = np.zeros((1, 1, vocab), dtype=np.float32)
        self._row: np.ndarray = self._logits[0, 0]
        self._top = np.zeros((1, 1, 1), dtype=np.int64)
        self._greedy = _flat(self._top)
        self._converted: list[tuple[np.ndarray, int]] = []
        """Outputs of another element type than ours: read and converted after each step instead."""
        for array, name, element in ((self._logits, "logits", ov.Type.f32), (self._top, "next_token", ov.Type.i64)):
            index, port = ports[name]
            if port.get_element_type() == element:
                self.request.set_output_tensor(index, ov.Tensor(array, shared_memory=True))
            else:
                self._converted.append((array, index))

    @property
    def logits(self) -> np.ndarray:
        """float32 ``[vocab]`` of the last step (this request's array: the next step overwrites it)."""
        return self._row

    def step(self, token: int, past_len: int, blocks: list[int], while_running: Callable[[], None] | None = None
             ) -> int:
        """Feed ``token`` after ``past_len`` positions over the table ``blocks`` (at least
        ``past_len // block_size + 1`` long; the blocks past that are not read); the greedy next
        token (the graph's ``next_token``), the logits in ``logits``. ``while_running()`` runs
        between the infer's start and the wait for it (a raise still waits for the step)."""
        table = blocks[: past_len // self._block_size + 1]
        if table != self._table:
            self._inputs.write("block_indices", padded_table(table))
            self._inputs.write("block_indices_begins", [0, len(table)])
            self._table = table
        self._ids[0] = token
        self._positions[0] = past_len
        self._past[0] = past_len
        self._context[0] = past_len + 1
        self.request.start_async()
        try:
            if while_running is not None:
                while_running()
        finally:
            self.request.wait()
        if self._converted:
            for array, index in self._converted:
                array[...] = self.request.get_output_tensor(index).data
        return self._greedy[0]


TABLE_BUCKET = 8
"""The shortest padded block table (``padded_table``)."""


def padded_table(blocks: list[int]) -> list[int]:
    """``blocks`` padded with block 0 to a power of two (at least ``TABLE_BUCKET``) entries: a step's
    ``block_indices``. PagedAttention reads a sequence's blocks between its ``block_indices_begins``,
    never the padding (the logits are bit-identical, measured), and the CPU plugin re-prepares the
    graph whenever an input's shape changes: ~5 ms of a ~20 ms one-token step of the default model
    (avx2, measured) each time a table grew by a block, once every 32 tokens of every sequence::

        padded_table([4, 9, 2]) == [4, 9, 2, 0, 0, 0, 0, 0]
    """
    size = max(TABLE_BUCKET, 1 << max(0, len(blocks) - 1).bit_length())
    return blocks + [0] * (size - len(blocks))


def _flat(array: np.ndarray) -> memoryview:
    """A one-dimensional memoryview of a C-contiguous array's elements (its own element type)."""
    flat: memoryview = array.reshape(-1).data
    return flat
