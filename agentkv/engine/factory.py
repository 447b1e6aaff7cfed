"""open_engine: the default engine for a device — the paged engine on CPU and GPU, the stateful one on NPU.

::

    engine = open_engine()                          # PagedEngine on CPU, the default model
    engine = open_engine(backend="stateful")        # StatefulEngine (an InferRequest per slot)
    engine = open_engine("path/to/ir", device="NPU")   # stateful: NPUs run the stateful form

``backend="auto"`` (the default, or ``AGENTKV_ENGINE``) picks paged unless the device is an NPU;
if the model cannot be turned into its PagedAttention form (``PagedFormUnsupported``, or
OpenVINO's error), it says why in a warning and uses the stateful engine; a bad option is the
caller's ``UserError``, never a fallback. Options go to the engine chosen (``num_slots``, ``exact``,
``kv_cache_precision``…; ``kv_cache_bytes`` / ``max_batch`` only mean something to the paged one).

The model is resolved first, once: a GGUF that cannot be converted raises ``ModelNotFound`` naming
the file and openvino-genai's cause, never a paged-engine fallback that converts it again.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Literal

from agentkv.engine.openvino.compile import openvino_cause
from agentkv.engine.openvino.engine import OpenVINOEngine
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.paged.compiled_pool import keep_limit
from agentkv.errors import ModelNotFound, PagedFormUnsupported, UserError

logger = logging.getLogger(__name__)

Backend = Literal["auto", "paged", "stateful"]
BACKENDS = ("auto", "paged", "stateful")
ENGINE_ENV = "AGENTKV_ENGINE"
_PAGED_ONLY = ("kv_cache_bytes", "max_batch", "max_step_tokens", "chunk_graph", "small_graph")


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
    if chosen in ("auto", "paged"):
        keep_limit()  # NOTE: a bad AGENTKV_KEEP_COMPILED fails before the model is resolved
    ir_dir = _ir_dir(model)
    if chosen == "auto":
        chosen = "stateful" if device.upper().startswith("NPU") else "paged"
        if chosen == "paged":
            try:
                return _paged(ir_dir, device, options)
            except (PagedFormUnsupported, RuntimeError) as error:  # NOTE: not the caller's own mistakes
                logger.warning("the paged engine is not available for this model (%s); using the stateful "
                               "engine", error)
                chosen = "stateful"
    if chosen == "paged":
        return _paged(ir_dir, device, options)
    from agentkv.engine.stateful.engine import StatefulEngine

    stateful_options = {k: v for k, v in options.items() if k not in _PAGED_ONLY}
    return StatefulEngine(ir_dir, device=device, **stateful_options)


def _ir_dir(model: str | os.PathLike[str] | None) -> Path:
    """``resolve_model(model).ir_dir`` (a GGUF converted once); a conversion that fails is
    ``ModelNotFound`` naming the file and the cause: ``_ir_dir("broken.gguf")``."""
    try:
        return resolve_model(model).ir_dir
    except RuntimeError as error:
        raise ModelNotFound(
            f"could not convert {model or 'the default model'} to OpenVINO IR ({openvino_cause(error)}); "
            "check that it is a complete GGUF file (download it again), or pass an OpenVINO IR directory "
            "exported by optimum-intel") from error


def _paged(ir_dir: Path, device: str, options: dict[str, Any]) -> OpenVINOEngine:
    from agentkv.engine.paged.engine import PagedEngine

    return PagedEngine(ir_dir, device=device, **options)
