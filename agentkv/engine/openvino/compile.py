"""Compiling a model for a device: errors that name the real cause, a cache dir that may fail, the LM head.

::

    compiled = compile_for_device(ov.Core(), model, "CPU", {"CACHE_DIR": "/tmp/c", "KV_CACHE_PRECISION": "f16"})
    matmul = lm_head(model)   # the MatMul before the logits, for slicing its input before compiling

A device this machine lacks is a ``UserError`` naming the devices it has. When the compiled-blob
cache (``CACHE_DIR``) cannot be written — a path under a file, a read-only disk, a permission
error while several processes share it — the model is compiled without the cache and one
warning line says so (the next start compiles again). Any other failure is
``ModelCompileFailed`` with OpenVINO's own cause.

Both forms slice the LM head's input before compiling (last positions only): ``lm_head`` finds
that MatMul behind any elementwise tail (Gemma 2's softcap ``cap * tanh(x / cap)``, a scale).
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import openvino as ov

from agentkv.errors import ModelCompileFailed, UserError

logger = logging.getLogger(__name__)

_VIRTUAL_DEVICES = ("AUTO", "HETERO", "MULTI", "BATCH")
"""Devices that stand for others (``AUTO:GPU,CPU``): OpenVINO checks what they name."""
_WHERE = re.compile(r"Exception from |Check '.*' failed at ")
"""Lines of an OpenVINO error that say where it was raised, not what went wrong."""
_ELEMENTWISE = frozenset({
    "Convert", "Tanh", "Sigmoid", "Exp", "Log", "Abs", "Negative", "Sqrt", "Clamp", "Erf",
    "Add", "Subtract", "Multiply", "Divide", "Power", "Minimum", "Maximum",
})
"""Ops that may sit between the LM head MatMul and the logits (each output position depends on
the same input position only, given constant other operands)."""


def compile_for_device(core: ov.Core, model: ov.Model, device: str, config: dict[str, str]) -> ov.CompiledModel:
    """``core.compile_model``; a device this machine lacks is a ``UserError`` naming the ones it
    has, a cache dir that cannot be written is skipped with a warning, and any other failure is
    ``ModelCompileFailed`` naming OpenVINO's cause."""
    cache_dir = config.get("CACHE_DIR")
    if cache_dir is not None and (problem := _unwritable(Path(cache_dir))) is not None:
        _warn_no_cache(cache_dir, problem)
        config = _without_cache(config)
        cache_dir = None
    try:
        return core.compile_model(model, device, config)
    except RuntimeError as error:
        cause = openvino_cause(error)
        available = list(core.available_devices)
        if not _is_available(device, available):
            example = f", e.g. device={available[0]!r}" if available else ""
            raise UserError(f"OpenVINO could not compile the model for device {device!r} ({cause}); this "
                            f"machine has {available}: pass one of those{example}") from error
        if cache_dir is None:
            raise _compile_failed(device, cause) from error
        first = error
    # NOTE: the cache dir passed the writability probe and still failed (another process's blob,
    # a permission race on a shared dir): if the model compiles without it, the cache was the cause
    try:
        compiled = core.compile_model(model, device, _without_cache(config))
    except RuntimeError as error:
        raise _compile_failed(device, openvino_cause(error)) from error
    _warn_no_cache(cache_dir, openvino_cause(first))
    return compiled


def lm_head(model: ov.Model) -> ov.Node | None:
    """The MatMul whose output reaches the ``logits`` output through elementwise ops with constant
    other operands only (none, a softcap, a scale), or None: ``lm_head(ov.Core().read_model(xml))``.

    Slicing that MatMul's input by position slices the logits the same way."""
    logits = next((o for o in model.outputs if "logits" in o.get_names()), None)
    if logits is None:
        return None
    node = logits.get_node().input_value(0).get_node()
    while node.get_type_name() != "MatMul":
        if node.get_type_name() not in _ELEMENTWISE:
            return None
        varying = [value for value in node.input_values() if not _is_broadcast_constant(value)]
        if len(varying) != 1:
            return None
        node = varying[0].get_node()
    return node


def _is_broadcast_constant(value: ov.Output) -> bool:
    """True for a Constant (behind Converts) of size 1 on every axis but the last (per position alike)."""
    node = value.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    shape = value.get_partial_shape()
    return (node.get_type_name() == "Constant" and shape.is_static
            and all(d.get_length() == 1 for d in list(shape)[:-1]))


def _unwritable(directory: Path) -> str | None:
    """Why ``directory`` cannot hold compiled blobs (created if missing), or None if it can."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot create it: {error.strerror or error}"
    if not os.access(directory, os.W_OK | os.X_OK):
        return "it is not writable"
    return None


def _without_cache(config: dict[str, str]) -> dict[str, str]:
    return {key: value for key, value in config.items() if key != "CACHE_DIR"}


def _warn_no_cache(cache_dir: str, problem: str) -> None:
    logger.warning("compiled-model cache %s unusable (%s): compiling without it; point AGENTKV_CACHE_DIR "
                   "at a writable directory to skip compilation on the next start", cache_dir, problem)


def openvino_cause(error: RuntimeError) -> str:
    """OpenVINO's first line that says what went wrong, not where it was raised (``Exception
    from <file>``, ``Check 'x' failed at <file>``)::

        openvino_cause(RuntimeError("Check 'ctx' failed at gguf.cpp:317:\\nFailed to open 'a.gguf'"))
        # → "Failed to open 'a.gguf'"
    """
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if not _WHERE.match(line)), lines[0] if lines else type(error).__name__)


def _is_available(device: str, available: list[str]) -> bool:
    """True if ``device`` is one this machine has (``GPU`` matches ``GPU.0``) or a virtual device."""
    name = device.split(":", 1)[0].split(".", 1)[0].upper()
    return name in _VIRTUAL_DEVICES or name in {d.split(".", 1)[0].upper() for d in available}


def _compile_failed(device: str, cause: str) -> ModelCompileFailed:
    return ModelCompileFailed(
        f"OpenVINO could not compile the model for device {device!r}: {cause}. The device is present: check "
        "the model files (re-export or re-convert them) and the engine options passed with it",
        device=device, cause=cause,
    )
