"""StepInputs: a paged step's inputs written in place into the infer request's own tensors.

``InferRequest.infer(dict)`` dispatches every input through openvino's Python data helpers on
each call: 0.28 ms of Python per step for the paged model's eight inputs on a 2-core avx2 CPU,
measured (issue 27: more than the rest of a token's overhead). The request's input tensors stay
the same objects between steps, so this keeps a numpy view of each and copies the step's values
into it; a tensor is re-shaped (and its view taken again) only when its shape changes — for a
decoding sequence, when its block table grows. Same values, same infer::

    inputs = StepInputs(request, {"input_ids": np.int64, "max_context_len": np.int32})
    inputs.write("input_ids", [5]); inputs.write("max_context_len", 131)
    request.infer()
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
