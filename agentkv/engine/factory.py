"""open_engine: the default engine for a device — the paged engine on CPU and GPU, the stateful one on NPU.

::

    engine = open_engine()                          # PagedEngine on CPU, the default model
    engine = open_engine(backend="stateful")        # StatefulEngine (an InferRequest per slot)
    engine = open_engine("path/to/ir", device="NPU")   # stateful: NPUs run the stateful form

``backend="auto"`` (the default, or ``AGENTKV_ENGINE``) picks paged unless the device is an NPU;
if the model cannot be turned into its PagedAttention form, it says why in a warning and uses
the stateful engine. Options go to the engine chosen (``num_slots``, ``exact``,
``kv_cache_precision``…; ``kv_cache_bytes`` / ``max_batch`` only mean something to the paged one).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

from agentkv.engine.openvino.engine import OpenVINOEngine
from agentkv.errors import UserError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "paged", "stateful"]
BACKENDS = ("auto", "paged", "stateful")
ENGINE_ENV = "AGENTKV_ENGINE"
_PAGED_ONLY = ("kv_cache_bytes", "max_batch", "max_step_tokens")


def open_engine(
    model: str | os.PathLike[str] | None = None,
    *,
    backend: Backend | None = None,
    device: str = "CPU",
    **options: Any,
) -> OpenVINOEngine:
    """The engine for ``model`` on ``device``: see the module docstring. ``backend`` None reads
    ``AGENTKV_ENGINE`` (default "auto")."""
    chosen = backend or os.environ.get(ENGINE_ENV, "auto")
    if chosen not in BACKENDS:
        raise UserError(f"engine backend must be one of {', '.join(BACKENDS)}, got {chosen!r} "
                        f"(from {'the backend argument' if backend else ENGINE_ENV})")
    if chosen == "auto":
        chosen = "stateful" if device.upper().startswith("NPU") else "paged"
        if chosen == "paged":
            try:
                return _paged(model, device, options)
            except (UserError, RuntimeError) as error:
                logger.warning("the paged engine is not available for this model (%s); using the stateful "
                               "engine", error)
                chosen = "stateful"
    if chosen == "paged":
        return _paged(model, device, options)
    from agentkv.engine.stateful.engine import StatefulEngine

    stateful_options = {k: v for k, v in options.items() if k not in _PAGED_ONLY}
    return StatefulEngine(model, device=device, **stateful_options)


def _paged(model: str | os.PathLike[str] | None, device: str, options: dict[str, Any]) -> OpenVINOEngine:
    from agentkv.engine.paged.engine import PagedEngine

    return PagedEngine(model, device=device, **options)
