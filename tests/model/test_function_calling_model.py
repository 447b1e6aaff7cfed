"""A fixed, representative subset of the function-calling set (``tests/data/function_calling.json``)
on the default model through the public API: raw-schema tools, ``tool_choice="required"``; at
least 95 % of the cases (here: every one) end in calls that parse and validate against their
schemas, and no text of any run holds tool-call markup. The subset is the first case of each of
the six categories (one tool, a choice of tools, parallel calls, parallel calls of several tools,
nested objects, enums): every shape of call the grammar and the parser handle, each run once.
The whole set (60 cases, ~4 min on a shared 2-core machine) is ``benchmarks/function_calling.py``.

The tests here run the real model; the scripted ones are in ``tests/test_function_calling.py``."""

from __future__ import annotations

import pytest
from test_function_calling import benchmark_module

pytestmark = pytest.mark.model


async def test_a_representative_subset_gives_valid_calls_and_no_markup_on_the_default_model(engine):
    bench = benchmark_module()
    fc_set = bench.FunctionCallingSet.load()
    outcomes = await bench.run_cases(engine, fc_set, fc_set.one_per_category())
    figures = bench.summary(outcomes)
    bad = {o.case_id: (o.finish_reason, o.calls, o.problems) for o in outcomes if not o.valid}
    assert figures["valid_ratio"] >= bench.TARGET, bad
    assert figures["markup_leaks"] == 0, bad
