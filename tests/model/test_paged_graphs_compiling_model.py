"""A paged model steps once its decode graph is compiled; its chunk and small-step graphs join as they
compile (``PagedModel.wait_for_graphs``), and a model released or dropped meanwhile still hands the
whole set on. On the zoo's tiny Llama 3.1 (mechanics, not numbers), with the extra compiles held
back by a gate so that "meanwhile" is certain, not a race."""

from __future__ import annotations

import gc
import threading
import time

import numpy as np
import pytest
from test_paged_model import TINY_IDS, tiny_files

pytestmark = pytest.mark.model

OPTIONS = {"num_blocks": 8, "kv_cache_precision": "f32", "exact": True, "chunk_graph": True}
"""Three graphs (the tiny model is small enough for the small one), exact numerics."""


@pytest.fixture
def gate(monkeypatch, private_compiled_pool):
    """The compiles of chunk and small graphs wait until ``gate.set()`` (the decode graph's do not);
    every compile is counted in ``gate.compiles``."""
    import agentkv.engine.paged.graphs as paged_graphs

    counted = paged_graphs.compile_for_device  # private_compiled_pool's counting wrapper
    opened = threading.Event()

    def held_back(core, model, *args, **kwargs):
        if not model.get_friendly_name().endswith("(decode steps)"):
            assert opened.wait(60), "the test never opened the gate"
        return counted(core, model, *args, **kwargs)

    monkeypatch.setattr(paged_graphs, "compile_for_device", held_back)
    opened.compiles = private_compiled_pool[1]  # type: ignore[attr-defined]
    opened.pool = private_compiled_pool[0]  # type: ignore[attr-defined]
    return opened


def steps(model, spans):
    from agentkv.engine.paged.model import SequenceStep

    return [model.step([SequenceStep(TINY_IDS[begin:end], begin, [0, 1], last_rows=end - begin)])
            for begin, end in spans]


def test_a_model_steps_on_its_decode_graph_while_the_others_compile_then_on_all_three(gate, monkeypatch):
    import agentkv.engine.paged.model as paged_model
    from agentkv.engine.paged.compiled_pool import CompiledPool
    from agentkv.engine.paged.model import PagedModel

    gate.set()
    reference = PagedModel(tiny_files(), **OPTIONS)
    assert reference.wait_for_graphs() == 3
    monkeypatch.setattr(paged_model, "COMPILED", CompiledPool())  # compile, not share the reference's live graphs
    gate.clear()
    model = PagedModel(tiny_files(), **OPTIONS)
    assert model.graphs == 1 and model.wait_for_graphs(timeout=0.2) == 1  # the others are held back
    before = [(0, 40), (40, 41), (41, 44)]  # a prefill, a decode step, a small step: all on the decode graph
    assert all(np.array_equal(a, b) for a, b in zip(steps(model, before), steps(reference, before)))
    gate.set()
    assert model.wait_for_graphs(timeout=60) == 3
    after = [(44, 47), (47, 48), (48, 60)]  # now on the small, decode and chunk graphs
    assert all(np.array_equal(a, b) for a, b in zip(steps(model, after), steps(reference, after)))
    ran = {name: tuple(getattr(model, f"_{name}_request").request.get_tensor("input_ids").shape)
           for name in ("decode", "small", "chunk")}  # noqa: SLF001 - which graph ran which step?
    assert ran == {"decode": (1,), "small": (3,), "chunk": (12,)}


def test_a_model_released_while_its_graphs_compile_waits_for_them_and_hands_on_the_whole_set(
        gate, monkeypatch):
    from agentkv.engine.paged.compiled_pool import KEEP_ENV
    from agentkv.engine.paged.model import PagedModel

    monkeypatch.setenv(KEEP_ENV, "3")
    model = PagedModel(tiny_files(), **OPTIONS)
    assert model.graphs == 1
    threading.Timer(0.3, gate.set).start()
    model.release()  # returns once the held-back graphs are in
    assert gate.is_set() and model.graphs == 0 and gate.pool.idle_graphs() == 3
    again = PagedModel(tiny_files(), **OPTIONS)
    assert again.graphs == 3 and len(gate.compiles) == 3  # taken from the pool, not compiled


def test_a_model_dropped_while_its_graphs_compile_hands_them_on_once_they_are_compiled(gate, monkeypatch):
    from agentkv.engine.paged.compiled_pool import KEEP_ENV
    from agentkv.engine.paged.model import PagedModel

    monkeypatch.setenv(KEEP_ENV, "3")
    dropped = PagedModel(tiny_files(), **OPTIONS)
    dropped.cycle = dropped  # type: ignore[attr-defined]  # as an engine and its backend refer to each other
    del dropped
    gc.collect()
    assert gate.pool.idle_graphs() == 0  # a partial set is never handed on
    gate.set()
    deadline = time.monotonic() + 60
    while gate.pool.idle_graphs() < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gate.pool.idle_graphs() == 3
    again = PagedModel(tiny_files(), **OPTIONS)
    assert again.graphs == 3 and len(gate.compiles) == 3
