"""benchmarks/window.py runs on the default engine and reports what a user feels (issue 23).

Run here on the scripted engine (no model): the point is the script's plumbing and its last-line
JSON, not the figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from agentkv.testing import ScriptedEngine

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def window(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import window as module

    return module


def test_the_window_benchmark_reports_each_policys_compacting_turn_latency_and_total(window, monkeypatch, capsys):
    opened = []

    def scripted(backend, **options):
        opened.append(backend)
        return ScriptedEngine([lambda call: "Noted: the committee, the rivers and the recipes."] * 200)

    monkeypatch.setattr(window, "open_engine", scripted)
    monkeypatch.setattr(sys, "argv", ["window.py", "--turns", "10", "--max-prompt-len", "700"])
    window.main()
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert opened == ["paged"] and summary["engine"] == "ScriptedEngine"
    for name in ("truncation", "sliding_window", "summarize_and_reprefill"):
        policy = summary["policies"][name]
        assert policy["compactions"] > 0 and policy["total_s"] > 0
        turn = policy["compacting_turn_ms"]
        assert 0 < turn["mean"] <= turn["max"]
    assert summary["truncation_over_sliding_compacting_turn"] > 0
