"""The public API documents itself (issue 48, item 3): every public field of every dataclass or
pydantic model ``agentkv`` and ``agentkv.memory`` export has an attribute docstring (a string on the
line after it, which the API reference renders), and every class, function, type alias and constant
they export has a docstring. Read from the source with ``ast``; OpenVINO is never imported."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap
from pathlib import Path

import pydantic

import agentkv
import agentkv.memory

PACKAGE = Path(agentkv.__file__).resolve().parent

KNOWN_GAPS: set[str] = set()
"""Fields left without a docstring, each with its reason (none since the results left
``engine/base.py`` for ``engine/generation.py``)."""


def undocumented_fields(node: ast.ClassDef) -> list[str]:
    """``Class.field`` for each public annotated field of the class body with no string literal
    on the statement after it: ``undocumented_fields(ast.parse(source).body[0])``."""
    missing = []
    for statement, following in zip(node.body, [*node.body[1:], None]):
        if not (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)):
            continue
        name = statement.target.id
        if name.startswith("_") or name == "model_config":
            continue
        documented = (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                      and isinstance(following.value.value, str) and following.value.value.strip())
        if not documented:
            missing.append(f"{node.name}.{name}")
    return missing


def class_node(cls: type) -> ast.ClassDef:
    """The ``ast`` of ``cls``'s own source."""
    node = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(node, ast.ClassDef), cls
    return node


def is_model(value: object) -> bool:
    """True for a dataclass or pydantic model class."""
    return inspect.isclass(value) and (dataclasses.is_dataclass(value) or issubclass(value, pydantic.BaseModel))


def exported_models() -> dict[str, type]:
    """The dataclasses and pydantic models of ``agentkv.__all__`` and ``agentkv.memory.__all__``
    (not those ``agentkv`` loads lazily: the engines, which import OpenVINO and are no models)."""
    found = {}
    for module in (agentkv, agentkv.memory):
        for name in getattr(module, "__all__", ()):
            value = vars(module).get(name)
            if is_model(value):
                found[f"{module.__name__}.{name}"] = value
    return found


def test_every_field_of_every_exported_event_result_and_record_has_a_docstring():
    models = exported_models()
    assert {"agentkv.RunResult", "agentkv.ToolReturned", "agentkv.Message", "agentkv.memory.CallRecord"} <= set(models)
    missing = set()
    for cls in models.values():
        for base in cls.__mro__:  # NOTE: a field a model inherits is documented where it is declared
            if is_model(base) and base.__module__.startswith("agentkv."):
                missing.update(undocumented_fields(class_node(base)))
    stale = KNOWN_GAPS - missing
    assert not stale, f"{sorted(stale)} have docstrings now: take them out of KNOWN_GAPS"
    assert sorted(missing - KNOWN_GAPS) == [], "write a docstring on the line after each of these fields"


def test_a_field_without_a_docstring_is_named():
    source = '''
class Point:
    x: int
    """Across."""
    y: int
    _cache: int
    label: str = ""
    """Shown beside it."""
'''
    node = ast.parse(source).body[0]
    assert isinstance(node, ast.ClassDef)
    assert undocumented_fields(node) == ["Point.y"]


def definition(module: str, name: str) -> tuple[ast.stmt, ast.stmt | None]:
    """The top-level statement defining ``name`` in ``module`` (followed through ``from x import
    name``) and the statement after it, read from the source alone."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    body = ast.parse(path.read_text(encoding="utf-8")).body
    found = None
    for statement, following in zip(body, [*body[1:], None]):
        if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and statement.name == name:
            found = (statement, following)  # NOTE: the last of @overload stubs is the implementation
        elif isinstance(statement, ast.Assign) and any(
                isinstance(target, ast.Name) and target.id == name for target in statement.targets):
            found = (statement, following)
    if found is not None:
        return found
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name for a in node.names):
            return definition(node.module, name)
    raise AssertionError(f"{name} is not defined in {module}")


def has_docstring(statement: ast.stmt, following: ast.stmt | None) -> bool:
    """A class or function with a docstring, or an assignment with a string on the next line."""
    if isinstance(statement, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return bool((ast.get_docstring(statement) or "").strip())
    return (isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str) and bool(following.value.value.strip()))


def test_every_class_function_and_type_alias_agentkv_exports_has_a_docstring():
    missing = [f"{module.__name__}.{name}" for module in (agentkv, agentkv.memory) for name in module.__all__
               if not has_docstring(*definition(module.__name__, name))]
    assert missing == [], "give each of these a docstring (a type alias or constant: a string on the line after it)"


def test_a_type_alias_is_documented_by_the_string_on_the_line_after_it():
    body = ast.parse('Pair = tuple[int, int]\n"""Two ids."""\nTriple = tuple[int, int, int]\nx = 1\n').body
    assert has_docstring(body[0], body[1])
    assert not has_docstring(body[2], body[3])
