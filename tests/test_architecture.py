"""The layer map holds: no import cycles (type-only imports included), every room (subpackage)
imports only rooms on lower floors, each layer imports only what DESIGN.md allows (engine: no
SQL, no messages; memory and kv: no OpenVINO), and no file passes 400 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "agentkv"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module ``path`` imports, wherever the import sits (TYPE_CHECKING and functions too)."""
    found: set[str] = set()
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return found


def graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    return {name: {m for m in imports_of(path) if m in modules and m != name} for name, path in modules.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_the_package_has_no_import_cycles_not_even_type_only_ones():
    edges = graph()
    # a package's __init__ re-exports its modules; a module importing a sibling through the
    # package is the same edge, so package -> own submodule edges do not count as cycles
    for name in edges:
        edges[name] = {t for t in edges[name] if not t.startswith(name + ".")}
    assert cycles(edges) == []


def test_each_layer_imports_only_what_the_design_allows():
    forbidden = {
        "agentkv.engine": ("sqlalchemy", "agentkv.memory", "agentkv.chat", "agentkv.run", "agentkv.runtime",
                           "agentkv.policies"),
        "agentkv.kv": ("sqlalchemy", "openvino", "openvino_genai", "agentkv.engine", "agentkv.chat"),
        "agentkv.kvstore": ("sqlalchemy", "openvino", "openvino_genai", "agentkv.engine", "agentkv.chat",
                            "agentkv.memory", "boto3"),
        "agentkv.memory": ("openvino", "openvino_genai", "agentkv.engine.stateful", "agentkv.engine.paged",
                           "agentkv.run", "agentkv.runtime", "agentkv.policies"),
        "agentkv.policies": ("agentkv.run", "agentkv.runtime", "agentkv.memory", "agentkv.engine.stateful",
                             "agentkv.engine.paged", "agentkv.agent", "openvino"),
        "agentkv.run": ("agentkv.server", "agentkv.runtime", "agentkv.memory", "sqlalchemy"),
    }
    broken = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        for layer, banned in forbidden.items():
            if name == layer or name.startswith(layer + "."):
                broken += [(name, m) for m in imports_of(path) if m.startswith(banned)]
    assert broken == []


def test_only_the_serve_command_imports_the_server_and_the_server_imports_no_engine_internals():
    """The server is the top layer (server → runtime → runner → policies → engine): nothing
    below it imports it, and it reaches the engine only through its protocol (``engine/base.py``; its results:
    ``engine/generation.py``)."""
    importers = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
        if name.startswith("agentkv.server") or name == "agentkv.cli.serve":
            if name.startswith("agentkv.server"):
                internals = [m for m in imports_of(path) if m.startswith("agentkv.engine.")
                             and m.split(".")[2] not in ("base", "generation")]
                assert internals == [], (name, internals)
            continue
        importers += [(name, m) for m in imports_of(path) if m.startswith("agentkv.server")]
    assert importers == []


FLOORS: tuple[tuple[str, int], ...] = (
    ("agentkv.errors", 0), ("agentkv.validation_text", 0),
    ("agentkv.kv", 1),                      # numpy only: token log, snapshots, RoPE, precisions
    ("agentkv.engine.counters", 2),         # what an engine holds and has done (its protocol returns it)
    ("agentkv.engine.generation", 2),       # what a generation call gives back (its protocol returns it)
    ("agentkv.kvstore", 2),                 # KV blocks in tiers (host, disk; S3 plugs in from memory)
    ("agentkv.engine.base", 3),             # the engine's protocols
    ("agentkv.engine.decode", 4), ("agentkv.engine.prefix", 4),
    ("agentkv.engine.session", 5),          # the KV session, its backend, SlotEngine
    ("agentkv.engine.openvino", 6),         # OpenVINOEngine(SlotEngine): the backends' shared parent
    ("agentkv.engine.stateful", 7), ("agentkv.engine.paged", 7),  # siblings: neither imports the other
    ("agentkv.engine.factory", 8), ("agentkv.engine", 8),
    ("agentkv.chat", 8), ("agentkv.tools", 9), ("agentkv.observe", 10), ("agentkv.result", 11),
    ("agentkv.events", 12), ("agentkv.policies", 13), ("agentkv.agent", 14), ("agentkv.memory", 15),
    ("agentkv.run", 16), ("agentkv.runtime", 17), ("agentkv.testing", 18), ("agentkv.server", 19),
    ("agentkv.cli", 20), ("agentkv", 21),
)
"""Rooms from the bottom up. A module may import its own room and rooms on lower floors only;
two rooms on one floor never import each other."""


def room_of(module: str) -> tuple[str, int]:
    matches = [(name, floor) for name, floor in FLOORS if module == name or module.startswith(name + ".")]
    return max(matches, key=lambda match: len(match[0]))


def test_every_room_imports_only_rooms_on_lower_floors():
    upward = []
    for module, targets in graph().items():
        here = room_of(module)
        if module == "agentkv":  # the package's __init__ re-exports the public API from every room
            continue
        upward += [(module, target) for target in sorted(targets)
                   if room_of(target)[0] != here[0] and room_of(target)[1] >= here[1]]
    assert upward == []


def test_every_package_and_top_level_module_is_a_room_on_the_map():
    """A new folder or top-level module is placed on a floor on purpose, not by accident."""
    packages = {module_name(p) for p in PACKAGE.rglob("__init__.py")}
    top_level = {module_name(p) for p in PACKAGE.glob("*.py") if p.name != "__init__.py"}
    assert sorted((packages | top_level) - {name for name, _ in FLOORS}) == []


def test_kv_imports_no_openvino_and_nothing_of_the_engine():
    broken = [(module_name(p), m) for p in (PACKAGE / "kv").rglob("*.py") for m in imports_of(p)
              if m.startswith(("openvino", "openvino_genai", "agentkv.engine"))]
    assert broken == []


def test_no_file_passes_400_lines():
    long = {str(p.relative_to(PACKAGE)): n for p in PACKAGE.rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


PAGED = "agentkv.engine.paged."
PAGED_CACHE_SIDE = {PAGED + m for m in ("block_pool", "block_table", "prefix", "shared_blocks")}
"""Which blocks hold which session's KV, what is shared and cached: block ids only, no tensors."""
PAGED_RUNNER_SIDE = {PAGED + m for m in ("model", "graphs", "compiled_pool", "request_inputs", "batcher",
                                         "draft_share", "draft_payoff", "block_precision", "block_io")}
"""The compiled graphs, their inputs, the step batcher and the KV tensors themselves."""
PAGED_COMPOSED = {PAGED + m for m in ("slot", "backend", "engine")}
"""Where the two sides meet: a slot is a block table fed by the model (vLLM v1's core / worker line)."""


def test_the_paged_engine_splits_into_a_cache_side_and_a_runner_side_composed_only_in_slot_backend_and_engine():
    modules = {module_name(p) for p in (PACKAGE / "engine" / "paged").glob("*.py") if p.name != "__init__.py"}
    assert modules == PAGED_CACHE_SIDE | PAGED_RUNNER_SIDE | PAGED_COMPOSED, "place a new paged module on a side"
    edges = graph()
    crossing = [(m, t) for m in PAGED_CACHE_SIDE for t in edges[m] if t in PAGED_RUNNER_SIDE | PAGED_COMPOSED]
    # the runner side reads only the pool's block size (BLOCK_SIZE) of the cache side
    crossing += [(m, t) for m in PAGED_RUNNER_SIDE for t in edges[m]
                 if t in PAGED_COMPOSED or (t in PAGED_CACHE_SIDE and t != PAGED + "block_pool")]
    cache_imports_openvino = [(m, t) for p in (PACKAGE / "engine" / "paged").glob("*.py")
                              if (m := module_name(p)) in PAGED_CACHE_SIDE
                              for t in imports_of(p) if t.startswith(("openvino", "openvino_genai"))]
    assert crossing + cache_imports_openvino == []
