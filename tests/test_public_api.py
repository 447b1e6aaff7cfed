"""The public API: one name per thing, no deprecated alias left, and importing agentkv loads no
model (nor OpenVINO)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import agentkv


@pytest.mark.parametrize(("module", "old"), [("agentkv", "AgentSession"), ("agentkv", "ToolCallEvent"),
                                             ("agentkv", "ToolResultEvent"), ("agentkv", "TurnMetricsEvent"),
                                             ("agentkv", "TokenDelta"), ("agentkv", "Runner"),
                                             ("agentkv.run.conversation", "AgentSession"),
                                             ("agentkv.events", "ToolCallEvent"), ("agentkv.events", "ToolResultEvent"),
                                             ("agentkv.events", "TurnMetricsEvent"), ("agentkv.run.loop", "Runner")])
def test_the_old_names_are_gone_before_the_first_release(module, old):
    import importlib

    with pytest.raises(AttributeError):
        getattr(importlib.import_module(module), old)


def test_the_runtime_keeps_no_last_resume_the_conversation_holds_its_resume_report():
    from agentkv import Runtime
    from agentkv.testing import ScriptedEngine

    assert not hasattr(Runtime(ScriptedEngine([])), "last_resume")


def test_every_exported_name_exists():
    missing = [name for name in agentkv.__all__ if name not in ("StatefulEngine", "PagedEngine")
               and not hasattr(agentkv, name)]
    assert missing == []


def test_importing_agentkv_loads_no_openvino():
    code = "import sys, agentkv; print('openvino' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize("name", ["KVPoolExhausted", "KVPoolCorrupt", "KVLogCorrupt", "UnknownStateLayout",
                                  "ModelCompileFailed", "ToolResultNotText"])
def test_every_error_lives_in_agentkv_errors_and_is_exported_under_the_root(name):
    import agentkv.errors

    error = getattr(agentkv, name)
    assert error is getattr(agentkv.errors, name) and error.__module__ == "agentkv.errors"
    assert issubclass(error, agentkv.AgentKVError)


def test_no_engine_module_defines_an_error_of_its_own_outside_agentkv_errors():
    import importlib
    import inspect
    import pkgutil

    import agentkv.engine

    elsewhere = []
    for info in pkgutil.walk_packages(agentkv.engine.__path__, "agentkv.engine."):
        module = importlib.import_module(info.name)
        elsewhere += [f"{info.name}.{n}" for n, obj in vars(module).items() if inspect.isclass(obj)
                      and issubclass(obj, Exception) and obj.__module__ == info.name]
    assert elsewhere == []
