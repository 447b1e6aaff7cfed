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
