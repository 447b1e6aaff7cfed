"""The process's pool of idle compiled paged graphs: keyed by model files and settings, bounded by
``AGENTKV_KEEP_COMPILED``, oldest dropped first (no OpenVINO compile here: stand-in graphs)."""

from __future__ import annotations

import os

import pytest

from agentkv.engine.openvino.models import ModelFiles
from agentkv.engine.paged.compiled_pool import KEEP_ENV, CompiledPool, GraphKey, HeldGraphs, keep_limit
from agentkv.errors import UserError


def held(graphs: int = 2) -> HeldGraphs:
    return HeldGraphs(tuple(object() for _ in range(graphs)), heads=3, head_dim=64, num_layers=30)  # type: ignore[misc]


@pytest.fixture
def files(tmp_path) -> ModelFiles:
    (tmp_path / "openvino_model.xml").write_text("<net/>", encoding="utf-8")
    (tmp_path / "openvino_model.bin").write_bytes(b"\0" * 16)
    return ModelFiles(ir_dir=tmp_path, gguf_path=None)


def key(files: ModelFiles, precision: str = "f16", graphs: int = 2, **config: str) -> GraphKey:
    return GraphKey.of(files, "CPU", {"KV_CACHE_PRECISION": precision, **config}, precision, graphs=graphs)


def test_graphs_given_back_are_taken_by_the_next_model_on_the_same_key_only(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "4")
    pool, graphs = CompiledPool(), held()
    pool.give_back(key(files), graphs)
    assert pool.idle_graphs() == 2
    assert pool.take(key(files, "u8")) is None and pool.take(key(files, graphs=1)) is None
    assert pool.take(key(files, INFERENCE_PRECISION_HINT="f32")) is None
    assert pool.take(key(files)) is graphs
    assert pool.take(key(files)) is None and pool.idle_graphs() == 0


def test_changed_model_files_make_another_key(files):
    before = key(files)
    weights = files.model_xml.with_suffix(".bin")
    weights.write_bytes(b"\1" * 32)
    os.utime(weights, ns=(1, 1))
    assert key(files) != before


def test_beyond_the_limit_the_oldest_idle_graphs_are_dropped(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "4")
    pool = CompiledPool()
    first, second, third = held(), held(), held()
    pool.give_back(key(files, "f16"), first)
    pool.give_back(key(files, "u8"), second)
    pool.give_back(key(files, "f32"), third)
    assert pool.idle_graphs() == 4
    assert pool.take(key(files, "f16")) is None
    assert pool.take(key(files, "u8")) is second and pool.take(key(files, "f32")) is third


def test_without_the_setting_nothing_is_kept(files, monkeypatch):
    monkeypatch.delenv(KEEP_ENV, raising=False)
    pool = CompiledPool()
    pool.give_back(key(files), held())
    assert keep_limit() == 0 and pool.idle_graphs() == 0 and pool.take(key(files)) is None


@pytest.mark.parametrize("value", ["-1", "two", "1.5"])
def test_a_bad_keep_setting_is_a_user_error_naming_it_and_the_pool_then_keeps_nothing(files, monkeypatch, value):
    monkeypatch.setenv(KEEP_ENV, value)
    with pytest.raises(UserError, match=KEEP_ENV):
        keep_limit()
    pool = CompiledPool()
    pool.give_back(key(files), held())  # an engine closing, or a collection: never raises
    assert pool.idle_graphs() == 0


def test_a_bad_keep_setting_fails_open_engine_instead_of_falling_back_to_the_stateful_engine(monkeypatch):
    from agentkv.engine.factory import open_engine

    monkeypatch.setenv(KEEP_ENV, "lots")
    with pytest.raises(UserError, match=KEEP_ENV):
        open_engine(None)


def test_a_graph_given_back_during_a_collection_while_the_pool_is_busy_waits_for_it(files, monkeypatch):
    """A finalizer may run in a thread that holds the pool's lock: give_back only queues."""
    monkeypatch.setenv(KEEP_ENV, "2")
    pool, graphs = CompiledPool(), held()
    with pool._lock:  # noqa: SLF001 - what a collection inside take() looks like
        pool.give_back(key(files), graphs)
    assert pool.take(key(files)) is graphs


def test_model_files_reached_through_symlinks_are_told_apart_by_what_they_lead_to(tmp_path):
    """A hub cache: two snapshots whose XML links to one blob, their weights to different blobs."""
    blobs = tmp_path / "blobs"
    blobs.mkdir()
    (blobs / "xml").write_text("<net/>", encoding="utf-8")
    (blobs / "bin-a").write_bytes(b"\0" * 16)
    (blobs / "bin-b").write_bytes(b"\1" * 16)
    keys = []
    for name in ("a", "b"):
        snapshot = tmp_path / name
        snapshot.mkdir()
        (snapshot / "openvino_model.xml").symlink_to(blobs / "xml")
        (snapshot / "openvino_model.bin").symlink_to(blobs / f"bin-{name}")
        keys.append(key(ModelFiles(ir_dir=snapshot, gguf_path=None)))
    assert keys[0] != keys[1]


def test_clear_drops_every_idle_graph(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "6")
    pool = CompiledPool()
    pool.give_back(key(files), held())
    pool.clear()
    assert pool.idle_graphs() == 0 and pool.take(key(files)) is None
