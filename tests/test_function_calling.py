"""A fixed, representative subset of the function-calling set (``tests/data/function_calling.json``,
every category) on the default model through the public API: raw-schema tools,
``tool_choice="required"``; at least 95 % of the cases end in calls that parse and validate
against their schemas, and no text of any run holds tool-call markup. The whole set (60 cases,
~4 min on a shared 2-core machine) is ``benchmarks/function_calling.py``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("jsonschema")

def benchmark_module() -> ModuleType:
    """``benchmarks/function_calling.py`` (the benchmarks folder is scripts, not a package)."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "function_calling.py"
    if str(path.parent) not in sys.path:  # its helpers (``_results``) sit beside it
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location("function_calling_benchmark", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_set_has_50_cases_in_every_category_with_dotted_names_nested_objects_and_enums():
    bench = benchmark_module()
    fc_set = bench.FunctionCallingSet.load()
    categories = {case["category"] for case in fc_set.cases}
    assert len(fc_set.cases) >= 50
    assert categories == {"simple", "multiple", "parallel", "parallel_multiple", "nested", "enum"}
    assert all(name in fc_set.tools for case in fc_set.cases for name in case["tools"] + case["expected"])
    chosen = fc_set.one_per_category()  # what the model test runs (the whole set takes minutes)
    assert sorted(case["category"] for case in chosen) == sorted(categories)
    assert sum("." in name for name in fc_set.tools) >= 10


