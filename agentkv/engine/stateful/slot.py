"""One KV slot: an InferRequest of the stateful model, and the forward pass run on it.

A slot knows tensors, not sessions. ``StatefulSlot.feed`` runs new tokens through the model on top
of the KV already held and returns the last position's logits (the compiled model slices
hidden states to the last token before the LM head)::

    logits = slot.feed(np.array([[5, 6, 7]]), past_len=0)   # prefill: logits [1, vocab]
    logits = slot.feed(np.array([[8]]), past_len=3)          # one decode step

Every method blocks (call it from a worker thread); the slot pool's lease gives one caller at
a time. A slot also holds a lock around every use of its request, so a clean-up that runs while
an interrupted step is still inside ``infer`` (Ctrl-C tears the event loop down, not the worker
thread) waits for that step instead of resetting a busy request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import numpy as np
import openvino as ov

from agentkv.engine.stateful.ov_state import KVLayout
from agentkv.errors import UserError


F = TypeVar("F", bound=Callable[..., Any])


def _exclusive(method: F) -> F:
    """Run ``method`` holding the slot's request lock (one use of the request at a time)."""

    @wraps(method)
    def locked(self: StatefulSlot, *args: Any, **kwargs: Any) -> Any:
        with self._busy:
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]


class StatefulSlot:
    """An InferRequest plus its KV layout."""

    def __init__(self, request: ov.InferRequest, index: int, input_names: frozenset[str]) -> None:
        self._busy = threading.RLock()
        self.request = request
        self.index = index
        self.layout = KVLayout.of(request)
        self._has_positions = "position_ids" in input_names
        self._has_beam_idx = "beam_idx" in input_names
        self.forward_passes = 0
        """Model runs (``feed`` calls) on this request so far."""

    @_exclusive
    def feed(
        self,
        input_ids: np.ndarray,
        past_len: int,
        beam_idx: np.ndarray | None = None,
        position_offset: int = 0,
    ) -> np.ndarray:
        """Run ``input_ids`` ``[batch, T]`` at positions ``past_len..past_len+T-1``.

        ``position_offset`` adds to every position id (the KV still holds ``past_len`` entries):
        a prefill at offset p is how RoPE conventions are measured (``kv/rope.py``).

        ``beam_idx`` ``[batch]`` reorders the cached batch rows before the step (beam search);
        by default each row keeps its own cache. Returns float32 logits ``[batch, vocab]`` of
        the last position. Mutates the KV: it now holds ``past_len + T`` positions per row.
        """
        batch, length = input_ids.shape
        if position_offset and not self._has_positions:
            raise UserError("this model has no position_ids input: it cannot prefill at an offset")
        inputs: dict[str, np.ndarray] = {
            "input_ids": np.ascontiguousarray(input_ids, dtype=np.int64),
            "attention_mask": np.ones((batch, past_len + length), dtype=np.int64),
        }
        if self._has_positions:
            start = past_len + position_offset
            positions = np.arange(start, start + length, dtype=np.int64)
            inputs["position_ids"] = np.broadcast_to(positions, (batch, length)).copy()
        if self._has_beam_idx:
            if beam_idx is None:
                beam_idx = np.arange(batch, dtype=np.int32)
            inputs["beam_idx"] = np.ascontiguousarray(beam_idx, dtype=np.int32)
        # NOTE: infer(dict) copies its inputs; set_tensor with numpy-backed tensors was measured
        # to crash once requests were replaced, so it is not used.
        self.request.infer(inputs)
        self.forward_passes += 1
        logits = self.request.get_tensor("logits").data  # [batch, 1 or T, vocab]
        return np.array(logits[:, -1, :], dtype=np.float32)

    @_exclusive
    def length(self) -> int:
        """Positions currently held per row."""
        try:
            return self.layout.length(self.request)
        except RuntimeError:
            return 0

    @_exclusive
    def reset(self) -> None:
        """Empty the KV."""
        self.request.reset_state()

    @_exclusive
    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions."""
        self.layout.trim(self.request, n)

    @_exclusive
    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[layers, batch, heads, T, dim]`` (copies)."""
        return self.layout.read(self.request)

    @_exclusive
    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the KV by ``keys`` / ``values`` ``[layers, batch, heads, T, dim]``."""
        self.layout.write(self.request, keys, values)

    @_exclusive
    def select_row(self, row: int, n: int) -> None:
        """Keep only batch row ``row`` and its first ``n`` positions."""
        self.layout.select_row(self.request, row, n)
