"""Compiling a model for a device, with an error that names the devices this machine has.

::

    compiled = compile_for_device(ov.Core(), model, "CPU", {"KV_CACHE_PRECISION": "f16"})
"""

from __future__ import annotations

import openvino as ov

from agentkv.errors import UserError


def compile_for_device(core: ov.Core, model: ov.Model, device: str, config: dict[str, str]) -> ov.CompiledModel:
    """``core.compile_model``; a failure (e.g. a device this machine lacks) is a ``UserError``
    naming the devices it has."""
    try:
        return core.compile_model(model, device, config)
    except RuntimeError as error:
        available = list(core.available_devices)
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        cause = next((line for line in lines if not line.startswith("Exception from")), type(error).__name__)
        raise UserError(f"OpenVINO could not compile the model for device {device!r} ({cause}); this "
                        f"machine has {available}: pass one of those, e.g. device={available[0]!r}"
                        ) from error
