"""The suite's switch: a test not marked ``model`` cannot build a real engine by accident."""

from __future__ import annotations

import pytest

from agentkv.testing import RealEngineForbidden, forbid_real_engines


def test_an_unmarked_test_that_builds_a_real_engine_is_refused_saying_what_to_do():
    from agentkv.engine.stateful.engine import StatefulEngine

    with pytest.raises(RealEngineForbidden, match="mark it @pytest.mark.model or use agentkv.testing.ScriptedEngine"):
        StatefulEngine(num_slots=1)


def test_leaving_the_switch_restores_reading_models():
    import openvino as ov

    outside = ov.Core.__dict__["read_model"]
    with forbid_real_engines():
        assert ov.Core.__dict__["read_model"] is not outside
    assert ov.Core.__dict__["read_model"] is outside
