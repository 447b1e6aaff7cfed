"""On the real model, across a process restart: a run stops on a call waiting for approval; a new
process resumes the session, approves the call, and the continuation prefills only its result.

The asking side runs in the test's process on the suite's engine (the default engine and numerics);
only the approving side is a new process (``tests/_approval_worker.py``), which is what a restart is:
that process holds nothing of the session but the store and its snapshot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _approval_worker import ask

pytestmark = pytest.mark.model
WORKER = Path(__file__).parents[1] / "_approval_worker.py"


def worker(*args: str) -> dict:
    done = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


async def test_an_approval_round_trip_across_a_process_restart_prefills_only_the_result(engine, tmp_path):
    db = f"sqlite:///{tmp_path / 'a.db'}"
    asked = await ask(engine, db)
    assert asked["finish"] == "approval_required" and len(asked["calls"]) == 1
    approved = worker("approve", db, asked["session"], asked["calls"][0])
    assert approved["waiting"] == asked["calls"] and approved["interrupted"] == 0
    assert approved["tool_result"] == ["deleted notes.txt"] or approved["tool_result"][0].startswith("deleted ")
    assert approved["restored"] >= asked["kv_tokens"] - 2  # the KV came back from the snapshot
    assert approved["reused"] >= asked["kv_tokens"] - 2
    assert approved["prefilled"] <= 40  # the tool result's turn, not the history
