"""A test switch that refuses to build a real engine, so scripted tests cannot load the model by accident.

::

    from agentkv.testing import forbid_real_engines

    with forbid_real_engines():
        PagedEngine()      # raises RealEngineForbidden: use ScriptedEngine, or mark the test `model`

Every real engine (paged, stateful, ``open_engine``'s) reads its OpenVINO model with
``openvino.Core.read_model`` before compiling it; inside the block that call raises instead.
The test suite's ``tests/conftest.py`` wraps each test not marked ``model`` in this block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

__all__ = ["REFUSAL", "RealEngineForbidden", "forbid_real_engines"]

REFUSAL = ("this test is not marked `model` but built a real engine: mark it @pytest.mark.model "
           "or use agentkv.testing.ScriptedEngine")


class RealEngineForbidden(RuntimeError):
    """A real engine was built inside ``forbid_real_engines()`` (a test switch, not a library error)."""


@contextmanager
def forbid_real_engines(message: str = REFUSAL) -> Iterator[None]:
    """Within the block, reading an OpenVINO model (what building any real engine starts with)
    raises ``RealEngineForbidden(message)``; the previous behaviour is restored on leaving.
    Not thread-safe across overlapping blocks: meant for one test at a time."""
    import openvino as ov

    original = ov.Core.__dict__["read_model"]

    def refuse(self: Any, *args: Any, **kwargs: Any) -> NoReturn:
        raise RealEngineForbidden(message)

    ov.Core.read_model = refuse
    try:
        yield
    finally:
        ov.Core.read_model = original
