"""One word, one meaning (issue 24): event literals are their class names, the public API holds
no deprecated alias, and real-model tests are marked once per file, in their own folder."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import re
import typing
import warnings
from pathlib import Path

import pytest

import agentkv
import agentkv.events

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "agentkv"
OLD_NAMES = {
    "AgentSession": ("agentkv", "Conversation"), "Runner": ("agentkv.run.loop", "run_turns"),
    "ToolCallEvent": ("agentkv", "ToolCalled"), "ToolResultEvent": ("agentkv", "ToolReturned"),
    "TurnMetricsEvent": ("agentkv", "ModelCallFinished"), "MaxTurnsExceeded": ("agentkv", "MaxModelCallsExceeded"),
    "ChatTokenizer": ("agentkv.engine.base", "Tokenizer"), "TokenDelta": ("agentkv", "TextDelta"),
}
"""Names agentkv no longer has, and where what replaced them lives."""


def snake_case(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def event_classes() -> list[type]:
    """Every class of ``agentkv.events`` with a ``type`` field: the members of ``RunEvent`` and any other."""
    members = set(typing.get_args(agentkv.events.RunEvent))
    defined = {c for _, c in inspect.getmembers(agentkv.events, inspect.isclass)
               if c.__module__ == "agentkv.events" and dataclasses.is_dataclass(c)
               and "type" in {f.name for f in dataclasses.fields(c)}}
    return sorted(members | defined, key=lambda c: c.__name__)


def test_snake_case_splits_on_every_capital():
    assert snake_case("ModelCallFinished") == "model_call_finished" and snake_case("TextDelta") == "text_delta"


@pytest.mark.parametrize("event", event_classes(), ids=lambda c: c.__name__)
def test_an_event_type_literal_is_its_class_name_in_snake_case(event):
    field = next(f for f in dataclasses.fields(event) if f.name == "type")
    annotation = ast.parse(str(field.type), mode="eval").body  # postponed: 'Literal["text_delta"]'
    assert isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value) == "Literal"
    assert ast.literal_eval(annotation.slice) == snake_case(event.__name__)
    assert field.default == snake_case(event.__name__)


def test_every_run_event_is_a_member_of_the_run_event_union():
    assert set(event_classes()) == set(typing.get_args(agentkv.events.RunEvent))


def public_objects() -> dict[str, object]:
    """``agentkv``'s public names (``__all__``) and the objects they stand for."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # a deprecated alias warns when read
        return {name: getattr(agentkv, name) for name in agentkv.__all__}


def test_a_public_class_or_function_is_exported_under_its_own_name():
    renamed = {name: obj.__name__ for name, obj in public_objects().items()
               if (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__name__ != name}
    assert renamed == {}


def test_no_two_public_names_stand_for_one_thing():
    by_object: dict[int, list[str]] = {}
    for name, obj in public_objects().items():
        by_object.setdefault(id(obj), []).append(name)
    assert [names for names in by_object.values() if len(names) > 1] == []


def test_every_public_class_or_function_of_agentkv_is_in_all():
    """An alias kept out of ``__all__`` would still be importable: none is."""
    stray = sorted(name for name, obj in vars(agentkv).items()
                   if not name.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
                   and getattr(obj, "__module__", "").startswith("agentkv") and name not in agentkv.__all__)
    assert stray == []


@pytest.mark.parametrize(("old", "new"), sorted(OLD_NAMES.items()), ids=sorted(OLD_NAMES))
def test_an_old_name_is_gone_and_its_replacement_is_there(old, new):
    module, name = new
    assert not hasattr(agentkv, old)
    assert hasattr(importlib.import_module(module), name)


def test_neither_the_package_nor_its_docs_name_an_old_class():
    """Not even in a docstring: nothing teaches a name that is gone (``TokenDelta`` is the
    engine's own per-token event, so it stays)."""
    old = re.compile(r"\b(" + "|".join(n for n in OLD_NAMES if n != "TokenDelta") + r")\b")
    root = PACKAGE.parent
    files = [*PACKAGE.rglob("*.py"), *(root / "examples").glob("*.py"), *(root / "benchmarks").glob("*.py"),
             root / "README.md"]
    found = [f"{p.relative_to(root)}:{n}: {m[0]}" for p in sorted(files)
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if (m := old.search(line))]
    assert found == []


@pytest.mark.parametrize(("owner", "old"), [("Runtime", "open_session"), ("Runtime", "close_session"),
                                            ("Runtime", "last_resume"), ("Agent", "max_turns")])
def test_the_runtime_and_the_agent_keep_no_old_member(owner, old):
    cls = getattr(agentkv, owner)
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    assert not hasattr(cls, old) and old not in fields


def module_marks(path: Path) -> list[str]:
    """``pytestmark = pytest.mark.model`` (or a list holding it) at module level: the marks it names."""
    marks = []
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark"
                                                for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            marks += [ast.unparse(v) for v in values]
    return marks


def model_marks_anywhere(path: Path) -> list[int]:
    """Lines where ``path`` uses ``pytest.mark.model`` (decorator, ``pytestmark``, ``pytest.param``)."""
    return sorted(node.lineno for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
                  if isinstance(node, ast.Attribute) and node.attr == "model"
                  and ast.unparse(node.value) == "pytest.mark")


def test_every_real_model_test_file_is_marked_model_at_module_level():  # helpers (zoo_helpers.py) hold no tests
    files = sorted((TESTS / "model").glob("test_*.py"))
    assert files, "tests/model/ holds the real-model tests"
    unmarked = [p.name for p in files if p.name != "conftest.py" and "pytest.mark.model" not in module_marks(p)]
    assert unmarked == []


def test_no_test_directly_in_tests_is_marked_model():
    marked = {p.name: lines for p in sorted(TESTS.glob("*.py")) if (lines := model_marks_anywhere(p))}
    assert marked == {}


def test_the_mark_finders_see_what_they_look_for(tmp_path):
    marked = tmp_path / "test_x.py"
    marked.write_text("import pytest\npytestmark = [pytest.mark.model, pytest.mark.slow]\n\n"
                      "@pytest.mark.model\ndef test_x():\n    pass\n", encoding="utf-8")
    assert module_marks(marked) == ["pytest.mark.model", "pytest.mark.slow"]
    assert model_marks_anywhere(marked) == [2, 4]
