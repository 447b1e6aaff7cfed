"""The process's pool of compiled paged graphs: live sets shared by leases on one key (opened once,
handed on when the last lease goes) and idle sets keyed by model files and settings, bounded by
``AGENTKV_KEEP_COMPILED``, oldest dropped first (no OpenVINO compile here: stand-in graphs)."""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import Future

import pytest

from agentkv.engine.openvino.models import ModelFiles
from agentkv.engine.paged.compiled_pool import KEEP_ENV, CompiledPool, GraphKey, HeldGraphs, finished, keep_limit
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


# ---- live sets shared by leases --------------------------------------------------------------


def opened(graphs: HeldGraphs, calls: list[int] | None = None):
    """An ``open_graphs`` for ``share``: ``graphs``, nothing left to compile; each call counted."""

    def open_graphs():
        if calls is not None:
            calls.append(1)
        return graphs, finished(graphs)

    return open_graphs


def test_a_live_set_is_shared_by_every_lease_on_its_key_and_opened_once(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "4")
    pool, graphs, calls = CompiledPool(), held(), []
    first = pool.share(key(files), opened(graphs, calls))
    second = pool.share(key(files), opened(held(), calls))
    assert calls == [1] and first.decode is second.decode is graphs and pool.users(key(files)) == 2
    other = pool.share(key(files, "u8"), opened(held(), calls))
    assert calls == [1, 1] and other.decode is not graphs and pool.users(key(files, "u8")) == 1
    assert pool.idle_graphs() == 0


def test_the_last_lease_released_hands_the_whole_set_on_and_releasing_twice_is_harmless(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "4")
    pool, graphs = CompiledPool(), held()
    first, second = pool.share(key(files), opened(graphs)), pool.share(key(files), opened(held()))
    first.release()
    first.release()
    assert pool.users(key(files)) == 1 and pool.idle_graphs() == 0
    second.release()
    assert pool.users(key(files)) == 0 and pool.idle_graphs() == 2
    calls: list[int] = []
    again = pool.share(key(files), opened(held(), calls))
    assert calls == [] and again.decode is graphs and pool.idle_graphs() == 0  # the idle set, not opened


def test_a_set_released_while_it_compiles_is_handed_on_once_whole_and_a_partial_set_never(files, monkeypatch):
    monkeypatch.setenv(KEEP_ENV, "4")
    pool = CompiledPool()
    decode, whole, partial_whole = held(1), Future(), Future()
    pool.share(key(files), lambda: (decode, whole)).release()
    pool.share(key(files, "u8"), lambda: (decode, partial_whole)).release()
    assert pool.users(key(files)) == 0 and pool.idle_graphs() == 0
    graphs = held()
    whole.set_result(graphs)
    partial_whole.set_result(held(1))  # an extra graph failed to compile: 1 of the key's 2
    assert pool.idle_graphs() == 2 and pool.take(key(files)) is graphs and pool.take(key(files, "u8")) is None


def test_a_share_while_the_set_is_opening_waits_for_it_instead_of_opening_another(files):
    pool, graphs, calls = CompiledPool(), held(), []
    opening, go_on = threading.Event(), threading.Event()

    def slow_open():
        calls.append(1)
        opening.set()
        assert go_on.wait(10)
        return graphs, finished(graphs)

    leases = []
    first = threading.Thread(target=lambda: leases.append(pool.share(key(files), slow_open)))
    first.start()
    assert opening.wait(10)
    second = threading.Thread(target=lambda: leases.append(pool.share(key(files), opened(held(), calls))))
    second.start()
    deadline = time.monotonic() + 10
    while pool.users(key(files)) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    second.join(0.1)
    assert second.is_alive() and pool.users(key(files)) == 2  # waiting for the first one's set
    go_on.set()
    first.join(10)
    second.join(10)
    assert calls == [1] and [lease.decode for lease in leases] == [graphs, graphs]


def test_a_failed_open_is_raised_to_the_shares_waiting_for_it_and_leaves_no_live_set(files):
    pool, opening, go_on = CompiledPool(), threading.Event(), threading.Event()

    def failing_open():
        opening.set()
        assert go_on.wait(10)
        raise RuntimeError("out of memory (a test)")

    errors: list[BaseException] = []

    def share(open_graphs) -> None:
        try:
            pool.share(key(files), open_graphs)
        except RuntimeError as error:
            errors.append(error)

    threads = [threading.Thread(target=share, args=(failing_open,))]
    threads[0].start()
    assert opening.wait(10)
    threads.append(threading.Thread(target=share, args=(opened(held()),)))
    threads[1].start()
    deadline = time.monotonic() + 10
    while pool.users(key(files)) < 2 and time.monotonic() < deadline:  # the second one waits for the first
        time.sleep(0.01)
    go_on.set()
    for thread in threads:
        thread.join(10)
    assert len(errors) == 2 and pool.users(key(files)) == 0
    calls: list[int] = []
    pool.share(key(files), opened(held(), calls))
    assert calls == [1]  # opened again, not the failed set


def test_a_lease_released_during_a_collection_while_the_pool_is_busy_is_counted_when_next_used(files, monkeypatch):
    """A model collected in a thread that holds the pool's lock: release only queues then."""
    monkeypatch.setenv(KEEP_ENV, "2")
    pool, graphs = CompiledPool(), held()
    lease = pool.share(key(files), opened(graphs))
    with pool._lock:  # noqa: SLF001 - what a collection inside share() looks like
        lease.release(collecting=True)
    assert pool.users(key(files)) == 0 and pool.take(key(files)) is graphs


def test_a_lease_released_while_another_thread_holds_the_pool_waits_and_frees_its_set_at_once(files):
    """An engine closed while another opens: its set goes now, not at the pool's next use."""
    pool = CompiledPool()
    lease = pool.share(key(files), opened(held()))
    holding, let_go = threading.Event(), threading.Event()

    def hold() -> None:
        with pool._lock:  # noqa: SLF001 - another model opening
            holding.set()
            let_go.wait(10)

    other = threading.Thread(target=hold)
    other.start()
    assert holding.wait(10)
    threading.Timer(0.1, let_go.set).start()
    lease.release()
    other.join(10)
    assert pool._left.empty() and key(files) not in pool._live  # noqa: SLF001 - counted, not queued
