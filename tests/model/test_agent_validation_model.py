"""Invalid agent and engine settings fail at construction with a UserError that says the fix.

The tests here run the real model; the scripted ones are in ``tests/test_agent_validation.py``."""

from __future__ import annotations

import pytest

from agentkv.errors import UserError

pytestmark = pytest.mark.model


def test_a_device_this_machine_lacks_is_a_user_error_naming_the_devices_it_has():
    import openvino as ov

    from agentkv.engine.stateful.engine import StatefulEngine

    missing = next(d for d in ("GPU", "NPU", "FPGA") if d not in ov.Core().available_devices)
    with pytest.raises(UserError, match=r"this machine has \['CPU'"):
        StatefulEngine(device=missing, num_slots=1)
