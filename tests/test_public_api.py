"""The public API: one name per thing, old names kept one release with a DeprecationWarning, and
importing agentkv loads no model (nor OpenVINO)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import agentkv


@pytest.mark.parametrize(("old", "new"), [("AgentSession", "Conversation"), ("ToolCallEvent", "ToolCalled"),
                                          ("ToolResultEvent", "ToolReturned"), ("TurnMetricsEvent", "StepFinished")])
def test_old_names_still_work_for_one_release_and_say_what_replaces_them(old, new):
    with pytest.warns(DeprecationWarning, match=new):
        assert getattr(agentkv, old) is getattr(agentkv, new)


def test_every_exported_name_exists():
    missing = [name for name in agentkv.__all__ if name not in ("StatefulEngine", "PagedEngine")
               and not hasattr(agentkv, name)]
    assert missing == []


def test_importing_agentkv_loads_no_openvino():
    code = "import sys, agentkv; print('openvino' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
