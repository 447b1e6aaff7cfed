"""StepRequest and StepInputs: one infer request of the paged model, its step inputs written in place.

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
"""

from __future__ import annotations

from collections.abc import Mapping
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


class StepRequest:
    """An infer request of a compiled paged model over the given KV block tensors (shared with any
    other request that steps the same blocks), with ``StepInputs`` for ``dtypes``."""

    def __init__(self, compiled: ov.CompiledModel, caches: Mapping[str, ov.Tensor],
                 dtypes: Mapping[str, type[np.generic]]) -> None:
        self.request = compiled.create_infer_request()
        for name, tensor in caches.items():
            self.request.set_tensor(name, tensor)
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
