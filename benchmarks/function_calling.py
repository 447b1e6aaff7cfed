"""Function calling: the share of BFCL-style cases whose tool calls parse and validate, on the default model.

The cases (``tests/data/function_calling.json``: simple, multiple tools to choose from, parallel,
parallel with several tools, nested objects, enums; dotted names such as ``geo.distance``
throughout) go through the public API as a client's would: each tool is a raw OpenAI schema
(``tool(dict)``: the caller executes it), ``tool_choice="required"``, one run per case. A case
counts as valid when the run stops with its calls (``finish_reason="tool_calls"``), every call
names an offered tool and its arguments validate against the tool's JSON schema, and no text of
the run (``final_text``, the recorded messages) holds tool-call markup. Whether the model chose
the expected tool is reported beside it, not counted. The last line is one JSON object.
Run: ``python benchmarks/function_calling.py [--cases N] [--max-new-tokens 256]``; the
real-model test (``tests/model/test_function_calling_model.py``) runs the first case of each
category (``FunctionCallingSet.one_per_category``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import jsonschema

from agentkv import Agent, GenerationConfig, Runtime, tool
from agentkv.chat.toolcalls import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, partial_open_tag
from agentkv.engine.base import Engine
from _results import print_result

CASES_PATH = Path(__file__).resolve().parents[1] / "tests" / "data" / "function_calling.json"
TARGET = 0.95
"""The share of valid cases issue 23 asks for."""


@dataclass(frozen=True)
class CaseOutcome:
    """What one case's run gave."""

    case_id: str
    category: str
    finish_reason: str
    calls: tuple[tuple[str, dict[str, Any]], ...]
    """(name, arguments) of each call the run stopped with."""
    problems: tuple[str, ...] = ()
    """Why a call does not validate, or a text that holds markup."""
    expected_hit: bool = False
    """The calls named every tool the case expects."""
    seconds: float = 0.0

    @property
    def valid(self) -> bool:
        """The run stopped with calls, all of them valid, and no text holds markup."""
        return self.finish_reason == "tool_calls" and bool(self.calls) and not self.problems


@dataclass
class FunctionCallingSet:
    """The tools (OpenAI format, by name) and the cases of the set."""

    tools: dict[str, dict[str, Any]]
    cases: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def load(cls, path: Path = CASES_PATH) -> FunctionCallingSet:
        data = json.loads(path.read_text(encoding="utf-8"))
        return cls(data["tools"], data["cases"])

    def subset(self, count: int) -> list[dict[str, Any]]:
        """``count`` cases taken round-robin across categories (every category represented)."""
        by_category: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for case in self.cases:
            by_category[case["category"]].append(case)
        chosen: list[dict[str, Any]] = []
        while len(chosen) < min(count, len(self.cases)):
            for queue in by_category.values():
                if queue and len(chosen) < count:
                    chosen.append(queue.pop(0))
        return chosen

    def one_per_category(self) -> list[dict[str, Any]]:
        """The first case of each category: the real-model test's subset
        (``fc_set.one_per_category()``)."""
        return self.subset(len({case["category"] for case in self.cases}))


def markup_in(text: str) -> bool:
    """True when ``text`` holds tool-call markup, a cut opening tag included."""
    return TOOL_CALL_OPEN[:5] in text or TOOL_CALL_CLOSE[:6] in text or partial_open_tag(text) > 0


def call_problems(name: str, arguments: dict[str, Any], offered: dict[str, dict[str, Any]]) -> list[str]:
    """Why one call is not valid (empty when it names an offered tool and its arguments validate).

    As BFCL's checker does, a key the schema does not declare is a fault even where JSON Schema
    would allow it (no ``additionalProperties``): a model that copies ``"type"`` or
    ``"description"`` into its arguments did not call the function."""
    if name not in offered:
        return [f"{name}: not an offered tool"]
    schema = offered[name]["function"]["parameters"]
    validator = jsonschema.validators.validator_for(schema)(schema)
    problems = [f"{name}: {error.message}" for error in validator.iter_errors(arguments)]
    return problems + [f"{name}: undeclared key {key!r}" for key in undeclared_keys(arguments, schema)]


def undeclared_keys(value: Any, schema: dict[str, Any]) -> list[str]:
    """Keys of ``value`` (at any depth) that the object schemas around them do not declare."""
    if not isinstance(value, dict) or not isinstance(schema.get("properties"), dict):
        return []
    if schema.get("additionalProperties", False) is not False:
        return []
    declared = schema["properties"]
    found = [key for key in value if key not in declared]
    for key, item in value.items():
        if key in declared:
            nested = declared[key]
            items = nested.get("items") if isinstance(item, list) else None
            if isinstance(items, dict):
                found += [k for element in item for k in undeclared_keys(element, items)]
            found += undeclared_keys(item, nested)
    return found


async def run_case(runtime: Runtime, fc_set: FunctionCallingSet, case: dict[str, Any],
                   max_new_tokens: int) -> CaseOutcome:
    """One case through the public API: raw-schema tools, ``tool_choice="required"``."""
    offered = {name: fc_set.tools[name] for name in case["tools"]}
    agent = Agent(name=f"fc-{case['id']}", tools=[tool(schema) for schema in offered.values()],
                  tool_choice="required", generation=GenerationConfig(max_new_tokens=max_new_tokens))
    session = await runtime.open_conversation(agent)
    start = time.perf_counter()
    try:
        result = await runtime.run(session, case["question"])
    finally:
        await runtime.close_conversation(session)
    seconds = time.perf_counter() - start
    calls = tuple((call.name, dict(call.arguments)) for call in result.pending_tool_calls)
    problems = [p for name, arguments in calls for p in call_problems(name, arguments, offered)]
    texts = [("final_text", result.final_text)] + [(f"{m.role} message", m.content) for m in result.new_messages]
    problems += [f"markup in the {where}: {text[-40:]!r}" for where, text in texts if markup_in(text)]
    called = {name for name, _ in calls}
    return CaseOutcome(case["id"], case["category"], result.finish_reason, calls, tuple(problems),
                       set(case["expected"]) <= called, seconds)


async def run_cases(engine: Engine, fc_set: FunctionCallingSet, cases: Sequence[dict[str, Any]], *,
                    max_new_tokens: int = 256) -> list[CaseOutcome]:
    """Each case in turn on ``engine`` (one runtime, a new session per case)."""
    runtime = Runtime(engine)
    return [await run_case(runtime, fc_set, case, max_new_tokens) for case in cases]


def summary(outcomes: Sequence[CaseOutcome]) -> dict[str, Any]:
    """The figures: valid cases and calls, markup leaks, expected tools, per category, time."""
    calls = sum(len(o.calls) for o in outcomes)
    invalid_calls = sum(1 for o in outcomes for p in o.problems if not p.startswith("markup"))
    categories: dict[str, list[CaseOutcome]] = defaultdict(list)
    for outcome in outcomes:
        categories[outcome.category].append(outcome)
    return {
        "cases": len(outcomes),
        "valid_cases": sum(o.valid for o in outcomes),
        "valid_ratio": round(sum(o.valid for o in outcomes) / max(1, len(outcomes)), 4),
        "calls": calls,
        "valid_call_ratio": round((calls - invalid_calls) / max(1, calls), 4),
        "markup_leaks": sum(1 for o in outcomes for p in o.problems if p.startswith("markup")),
        "finish_reasons": dict(sorted(_count(o.finish_reason for o in outcomes).items())),
        "expected_tools_ratio": round(sum(o.expected_hit for o in outcomes) / max(1, len(outcomes)), 4),
        "per_category": {name: f"{sum(o.valid for o in group)}/{len(group)}" for name, group in categories.items()},
        "mean_case_s": round(statistics.fmean(o.seconds for o in outcomes), 3) if outcomes else 0.0,
        "total_s": round(sum(o.seconds for o in outcomes), 1),
    }


def _count(values: Any) -> dict[str, int]:
    counts: dict[str, int] = defaultdict(int)
    for value in values:
        counts[value] += 1
    return counts


async def main(count: int | None, max_new_tokens: int) -> None:
    from agentkv.engine.factory import open_engine

    fc_set = FunctionCallingSet.load()
    cases = fc_set.subset(count) if count else fc_set.cases
    engine = open_engine()
    outcomes = await run_cases(engine, fc_set, cases, max_new_tokens=max_new_tokens)
    for outcome in outcomes:
        mark = "ok " if outcome.valid else "BAD"
        shown = "; ".join(f"{name}({json.dumps(args, ensure_ascii=False)})" for name, args in outcome.calls)
        print(f"{mark} {outcome.case_id:<22} {outcome.finish_reason:<14} {outcome.seconds:5.1f}s {shown[:110]}")
        for problem in outcome.problems:
            print(f"      {problem}")
    figures = summary(outcomes)
    print(f"\nvalid cases: {figures['valid_cases']}/{figures['cases']} = {figures['valid_ratio']:.1%} "
          f"(target {TARGET:.0%}); valid calls {figures['valid_call_ratio']:.1%} of {figures['calls']}; "
          f"markup leaks {figures['markup_leaks']}; expected tools called {figures['expected_tools_ratio']:.1%}")
    print_result(__file__, {"benchmark": "function_calling", "target": TARGET, **figures})


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=None, help="run this many cases (round-robin by category)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    options = parser.parse_args()
    anyio.run(main, options.cases, options.max_new_tokens)
