"""Compiling a model for a device: errors that name the real cause, and a cache dir that may fail.

::

    compiled = compile_for_device(ov.Core(), model, "CPU", {"CACHE_DIR": "/tmp/c", "KV_CACHE_PRECISION": "f16"})

A device this machine lacks is a ``UserError`` naming the devices it has. When the compiled-blob
cache (``CACHE_DIR``) cannot be written — a path under a file, a read-only disk, a permission
error while several processes share it — the model is compiled without the cache and one
warning line says so (the next start compiles again). Any other failure is
``ModelCompileFailed`` with OpenVINO's own cause.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import openvino as ov

from agentkv.errors import ModelCompileFailed, UserError

logger = logging.getLogger(__name__)

_VIRTUAL_DEVICES = ("AUTO", "HETERO", "MULTI", "BATCH")
"""Devices that stand for others (``AUTO:GPU,CPU``): OpenVINO checks what they name."""


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
        cause = _cause(error)
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
        raise _compile_failed(device, _cause(error)) from error
    _warn_no_cache(cache_dir, _cause(first))
    return compiled


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


def _cause(error: RuntimeError) -> str:
    """OpenVINO's first line that says what went wrong (not an ``Exception from <file>`` line)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return next((line for line in lines if not line.startswith("Exception from")), type(error).__name__)


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
