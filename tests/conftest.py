"""Shared fixtures: real engines on the default model (compiled once per test session), and
stores on SQLite and (with ``AGENTKV_TEST_POSTGRES_URL``) PostgreSQL. A test not marked
``model`` that builds a real engine fails (``agentkv.testing.forbid_real_engines``). Under
pytest-xdist's ``--dist loadfile`` (``make test``) the files on a session paged engine go to one
worker together (``pytest_xdist_make_scheduler``)."""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import OperationalError, ProgrammingError

from agentkv.memory import Store
from agentkv.testing import RealEngineForbidden, forbid_real_engines
from agentkv.testing.engine_guard import REFUSAL

PG_ENV = "AGENTKV_TEST_POSTGRES_URL"

# NOTE: engines closed in one test hand their compiled paged graphs to the next test's engine on
# the same settings (``engine/paged/compiled_pool.py``): ~5 s of compiling per default engine saved;
# three sets of the default model's three graphs
os.environ.setdefault("AGENTKV_KEEP_COMPILED", "9")
# NOTE: rich pins a Console's width when COLUMNS is set as it is made, and the CLI's consoles are
# made at import: a caller's COLUMNS (pytest-xdist's workers set 80) would override the widths the
# CLI tests pass to CliRunner and wrap the lines they look for
for _variable in ("COLUMNS", "LINES"):
    os.environ.pop(_variable, None)


def _pin_worker_to_one_core() -> None:
    """With ``AGENTKV_TEST_CORE_PER_WORKER=1`` (``make test``'s model pass), each pytest-xdist
    worker runs on one core of its own, so OpenVINO (which sizes its thread pool from the CPUs it
    may use, when first loaded: after this) computes single-threaded in each worker, and the
    processes a test starts inherit that core. NOTE: two workers each with one core finish the model
    tests ~30 % sooner than one process with both (a subset, 2 avx2 cores: 182 s against 260 s):
    that process leaves a core idle through Python, tokenizer, SQL and subprocess time."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if os.environ.get("AGENTKV_TEST_CORE_PER_WORKER") != "1" or not worker.startswith("gw"):
        return
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(worker[2:]) % len(cores)]})


_pin_worker_to_one_core()

from agentkv.engine.base import GenerationConfig  # noqa: E402  (after the environment above is set)


REAL_ENGINE_FIXTURES = frozenset({"engine", "stateful_engine", "paged_engine", "engine_f32", "paged_exact",
                                  "any_engine", "any_exact_engine", "engine_plain"})
"""The fixtures below that build (or pick, with ``getfixturevalue``) a real engine."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """Run each test not marked ``model`` with real engines refused. NOTE: a hook, not an
    autouse fixture: pytest sets session-scoped fixtures (the engines below) up before any
    function-scoped one, so only a wrapper around the whole test also covers their first build."""
    if item.get_closest_marker("model") is not None:
        yield
        return
    with forbid_real_engines():
        yield


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Refuse an unmarked test that asks for an engine fixture before that fixture is built:
    pytest keeps a session fixture's error and would raise it again in every later model test."""
    wanted = REAL_ENGINE_FIXTURES.intersection(getattr(item, "fixturenames", ()))
    if wanted and item.get_closest_marker("model") is None:
        raise RealEngineForbidden(f"{REFUSAL} (it uses the fixture {', '.join(sorted(wanted))})")


TEST_ENGINE = os.environ.get("AGENTKV_TEST_ENGINE", "paged")
"""Which engine the ``engine`` fixture is: "paged" (the default engine) or "stateful"."""


SESSION_PAGED_GROUP = "session-paged-engines"
"""The one work unit (``--dist loadfile``, ``make test``) of every file with a test on a session paged
engine (``paged_engine``, ``paged_exact``, or ``engine`` when it is the paged one)."""
GROUPS_FILE = "agentkv_session_paged_files"
"""The ``workerinput`` key naming the file where each pytest-xdist worker writes which test files
use a session paged engine (as collected), for the controller's scheduler to read."""


def uses_a_session_paged_engine(item: pytest.Item) -> bool:
    """Whether ``item`` runs on a session paged engine: asks for one, for the ``engine`` that is
    one, or is the ``"paged"`` case of a fixture (``any_engine``, a test's own ``backend``) that
    picks one with ``getfixturevalue``."""
    names = set(getattr(item, "fixturenames", ()))
    if names & {"paged_engine", "paged_exact"} or ("engine" in names and TEST_ENGINE == "paged"):
        return True
    callspec = getattr(item, "callspec", None)
    picked = callspec.params.values() if callspec is not None else ()
    return item.get_closest_marker("model") is not None and any(value in ("paged", "paged-exact") for value in picked)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """pytest-xdist's controller: tell each worker where to write its files on session paged engines."""
    if _groups_path_key not in node.config.stash:
        node.config.stash[_groups_path_key] = _new_groups_path()
    node.workerinput[GROUPS_FILE] = str(node.config.stash[_groups_path_key])


def _new_groups_path() -> Path:
    """A file name of this run's own in a new temporary directory."""
    import tempfile

    return Path(tempfile.mkdtemp(prefix="agentkv-test-groups-")) / "session_paged_files.txt"


_groups_path_key = pytest.StashKey[Path]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """In a pytest-xdist worker told where (``pytest_configure_node``): write the test files that
    use a session paged engine, for ``SharedEngineFileScheduling``. NOTE: a file, not an xdist_group
    mark: ``--dist loadgroup`` passes the group in the test's id, which pytest 9.2 no longer lets a
    plugin change (pytest-xdist issue 1386: the marks are silently ignored). tryfirst: written before
    pytest-xdist's own hook tells the controller this worker has collected."""
    target = getattr(session.config, "workerinput", {}).get(GROUPS_FILE)
    if target is None:
        return
    files = sorted({item.nodeid.split("::", 1)[0] for item in session.items if uses_a_session_paged_engine(item)})
    written = Path(f"{target}.{os.getpid()}")
    written.write_text("\n".join(files), encoding="utf-8")
    written.replace(target)  # whole, as each worker writes the same list


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` (``make test``) with the files that use a session paged engine sent to
    one worker as one unit: that worker compiles each of those engines' graphs (~10 s of CPU a set
    on one core; the compiled-blob cache cannot hold them), where whole files per worker had both
    workers compile both. Any other ``--dist`` is pytest-xdist's own."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedEngineFileScheduling(LoadFileScheduling):
        """Whole files per worker, the session-paged-engine files as one unit, handed out longest
        first: that unit, then the other model files (``tests/model/``: seconds to a minute each,
        a file of one test among them), then the rest, each kind by test count. NOTE: overrides
        pytest-xdist's ``_split_scope`` (the unit of a test id) and ``_assign_work_unit`` (which
        takes the first unit of ``workqueue``), as its own schedulers do: by test count alone, the
        model files of one test went last and one worker ran on alone through the longest of them."""

        _shared: frozenset[str] | None = None
        _ordered = False

        def _assign_work_unit(self, node) -> None:
            if not self._ordered:
                self._ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: (
                    unit[0] != SESSION_PAGED_GROUP, not unit[0].startswith("tests/model/"), -len(unit[1])))
                self.workqueue.clear()
                self.workqueue.update(units)
            super()._assign_work_unit(node)

        def _split_scope(self, nodeid: str) -> str:
            if self._shared is None:
                path = config.stash.get(_groups_path_key, None)
                listed = path.read_text(encoding="utf-8").splitlines() if path is not None and path.exists() else ()
                self._shared = frozenset(listed)
            file = nodeid.split("::", 1)[0]
            return SESSION_PAGED_GROUP if file in self._shared else file

    return SharedEngineFileScheduling(config, log)


def pytest_unconfigure(config: pytest.Config) -> None:
    """Remove the controller's temporary directory of worker lists, if it made one."""
    import shutil

    path = config.stash.get(_groups_path_key, None)
    if path is not None:
        shutil.rmtree(path.parent, ignore_errors=True)


@pytest.fixture
def private_compiled_pool(monkeypatch):
    """A fresh pool of compiled paged graphs for this test, and a list that grows by one per
    compile: ``pool, compiles = private_compiled_pool`` (the suite's shared pool is left alone)."""
    import agentkv.engine.paged.graphs as paged_graphs
    import agentkv.engine.paged.model as paged_model
    from agentkv.engine.paged.compiled_pool import CompiledPool

    pool, compiles, real = CompiledPool(), [], paged_graphs.compile_for_device

    def counted(*args, **kwargs):
        compiles.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(paged_model, "COMPILED", pool)
    monkeypatch.setattr(paged_graphs, "compile_for_device", counted)
    return pool, compiles


@pytest.fixture(scope="session")
def stateful_engine():
    """The stateful engine with the default settings (f16 KV cache, this CPU's numerics), 4 slots."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=4)


@pytest.fixture(scope="session")
def paged_engine():
    """The paged engine with its default numerics, 4 slots, 256 MiB of KV blocks."""
    from agentkv.engine.paged.engine import PagedEngine

    return PagedEngine(num_slots=4, kv_cache_bytes=256 << 20)


@pytest.fixture(scope="session")
def engine(request: pytest.FixtureRequest):
    """The default engine with the default settings: the engine ``AGENTKV_TEST_ENGINE`` names
    (paged unless told otherwise), so the whole suite can run on either."""
    return request.getfixturevalue("paged_engine" if TEST_ENGINE == "paged" else "stateful_engine")


@pytest.fixture(scope="session")
def engine_f32():
    """The strict-invariant configuration: ``exact=True`` (f32 KV, f32 compute, no dynamic
    quantisation), so chunking moves logits by ~5e-5 on any CPU. No prefix cache: a hit would
    make a "one-pass prefill" reference not one-pass."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=3, exact=True, prefix_cache_bytes=0)


@pytest.fixture(scope="session")
def paged_exact():
    """The paged engine with ``exact=True`` (f32 blocks, f32 compute, no dynamic quantisation)
    and no prefix cache, 6 slots: a batched step then equals each sequence's solo step."""
    from agentkv.engine.paged.engine import PagedEngine

    return PagedEngine(num_slots=6, exact=True, prefix_cache_bytes=0, kv_cache_bytes=128 << 20)


@pytest.fixture(params=["stateful", "paged"])
def any_engine(request: pytest.FixtureRequest):
    """Each engine with its default numerics: the protocol tests run on both."""
    return request.getfixturevalue("stateful_engine" if request.param == "stateful" else "paged_engine")


@pytest.fixture(params=["stateful", "paged"])
def any_exact_engine(request: pytest.FixtureRequest):
    """Each engine with ``exact=True`` numerics and no prefix cache."""
    return request.getfixturevalue("engine_f32" if request.param == "stateful" else "paged_exact")


@pytest.fixture(scope="session")
def engine_plain():
    """The default engine settings with no prefix cache: for references that must be a
    genuine one-pass prefill and for comparisons with LLMPipeline, which has no prefix cache."""
    from agentkv.engine.stateful.engine import StatefulEngine

    return StatefulEngine(num_slots=2, prefix_cache_bytes=0)


@pytest.fixture
def chat_ids(engine):
    """Render a one-turn chat prompt to ids: ``chat_ids("hi")``."""

    def render(question: str, system: str | None = None) -> list[int]:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": question})
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return engine.tokenizer.encode(text)

    return render


GREEDY = GenerationConfig(max_new_tokens=24)


def fresh_postgres_database(base_url: str) -> Iterator[str]:
    """Create an empty database for one test on the server of ``base_url``; drop it afterwards."""
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    name = f"agentkv_test_{uuid.uuid4().hex[:12]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield make_url(base_url).set(database=name).render_as_string(hide_password=False)
    finally:
        drop_postgres_database(admin, name)
        admin.dispose()


def drop_postgres_database(admin: Engine, name: str) -> None:
    """Drop a test database. A plain DROP first: the server itself stops an autovacuum worker
    busy in it, where ``WITH (FORCE)`` would need the right to signal that worker's (superuser)
    process — a CI server refused exactly that. FORCE stays the fallback for a connection a
    failing test left open."""
    statements = (f'DROP DATABASE IF EXISTS "{name}"', f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    for attempt, statement in enumerate(statements, start=1):
        try:
            with admin.connect() as conn:
                conn.execute(text(statement))
            return
        except (OperationalError, ProgrammingError):
            if attempt == len(statements):
                raise


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'agentkv.db'}"
        return
    base = os.environ.get(PG_ENV)
    if not base:
        pytest.skip(f"set {PG_ENV} (bash scripts/start_postgres.sh prints one) to test PostgreSQL")
    yield from fresh_postgres_database(base)


@pytest.fixture
async def store(store_url: str, tmp_path: Path) -> AsyncIterator[Store]:
    opened = Store(store_url, snapshot_dir=tmp_path / "snapshots")
    yield opened
    await opened.close()


@pytest.fixture
def fake_gguf_conversion(monkeypatch, tmp_path):
    """openvino-genai's GGUF conversion faked (it writes placeholder IR files), the model cache in
    ``tmp_path / "cache"`` and a tiny GGUF to convert: ``gguf = fake_gguf_conversion()``;
    ``fake_gguf_conversion(on_convert=f)`` calls ``f()`` as each conversion starts."""
    import openvino_genai

    from agentkv.engine.openvino import models

    def make(on_convert=None) -> Path:
        class FakePipeline:
            def __init__(self, path, device, **kwargs):
                if on_convert is not None:
                    on_convert()
                for name in models.IR_FILES:
                    (Path(path).parent / name).write_text("ir", encoding="utf-8")

        monkeypatch.setattr(openvino_genai, "LLMPipeline", FakePipeline)
        monkeypatch.setattr(models.ModelFiles, "gguf_metadata", lambda self: {})
        monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "cache"))
        gguf = tmp_path / "tiny.gguf"
        gguf.write_bytes(b"GGUF")
        return gguf

    return make
