"""Shared pieces of the model-zoo conformance tests, and the new-process side of their restore check.

The zoo (tests/data/zoo) holds tiny random-weight IRs of seven instruct families. Each test module
opens one engine per family with ``open_zoo_engine`` (exact numerics, a prefix cache, small KV), or
shares the session's ``exact_zoo_engine`` (the same without a prefix cache); the restore test
resumes stored conversations in a fresh process by running this file::

    python tests/model/zoo_helpers.py <jobs.json>

``jobs.json`` is a list of ``{"family", "url", "conversation_id", "text"}``; the worker resumes each
session from its SQLite store with ``RESTORE_AGENT``, runs ``text`` as the next turn and prints one
JSON line: per family, the answer's token ids and the resumed call's metrics (or the error).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "reference.json").is_file()) if ZOO.is_dir() else []
ZOO_KV_BYTES = 16 << 20
"""KV blocks per engine: ample for the few short conversations a module runs."""

RESTORE_INSTRUCTIONS = "You are a terse assistant for a parcel company. Answer in one short sentence."
RESTORE_TURNS = ("Where is my parcel?", "It was sent from Leeds last week.", "Can I change the address?")
RESTORE_MAX_NEW = 10


def open_zoo_engine(family: str) -> Any:
    """The zoo model ``family`` on the paged engine: exact numerics (f32 KV, no dynamic
    quantisation), the default prefix cache, two slots: ``open_zoo_engine("gemma3")``."""
    from agentkv import open_engine

    return open_engine(ZOO / family, exact=True, num_slots=2, kv_cache_bytes=ZOO_KV_BYTES)


_EXACT_ENGINES: dict[tuple[str, int], Any] = {}


def exact_zoo_engine(family: str, num_slots: int = 2) -> Any:
    """The zoo model ``family`` on the paged engine with exact numerics and no prefix cache,
    opened once per test session for each slot count: the zoo modules share it (each closes its
    sessions; a ``Runtime`` registers its agents' prefixes there, which moves later prompts' chunk
    boundaries: exact numerics keep logits within ~5e-5, and no assertion depends on a near tie):
    ``exact_zoo_engine("qwen3")``, ``exact_zoo_engine("gemma2", num_slots=1)``."""
    from agentkv import open_engine

    key = (family, num_slots)
    if key not in _EXACT_ENGINES:
        _EXACT_ENGINES[key] = open_engine(ZOO / family, exact=True, num_slots=num_slots, prefix_cache_bytes=0,
                                          kv_cache_bytes=ZOO_KV_BYTES)
    return _EXACT_ENGINES[key]


def restore_agent() -> Any:
    """The agent of the restore test, the same in the test and in the worker process."""
    from agentkv import Agent, GenerationConfig

    return Agent(name="zoo-restore", instructions=RESTORE_INSTRUCTIONS,
                 generation=GenerationConfig(max_new_tokens=RESTORE_MAX_NEW))


def generation_eos(family: str) -> list[int]:
    """``eos_token_id`` of the family's ``generation_config.json`` as a list:
    ``generation_eos("gemma3") == [1, 5]``."""
    value = json.loads((ZOO / family / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"]
    return [value] if isinstance(value, int) else list(value)


def text_end(decode: Any, ids: Sequence[int], text: str) -> int:
    """The fewest leading ``ids`` whose decode contains ``text`` (``len(ids) + 1`` if none does):
    where a system prompt ends in a rendered prompt, ``text_end(tok.decode, prompt, SYSTEM)``."""
    low, high = 0, len(ids) + 1
    while low < high:  # decoded prefixes only grow, so containment is monotonic
        middle = (low + high) // 2
        if middle <= len(ids) and text in decode(list(ids[:middle])):
            high = middle
        else:
            low = middle + 1
    return low


def common_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two id sequences: ``common_len([1, 2, 3], [1, 2, 4]) == 2``."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class ForcedIds:
    """A ``TokenConstraint`` that allows exactly ``ids[i]`` at step ``i``, then is finished:
    ``ForcedIds([5], vocab_size)`` makes a model emit token 5 whatever its logits say."""

    def __init__(self, ids: Sequence[int], vocab_size: int) -> None:
        self._ids, self._vocab_size, self._step = list(ids), vocab_size, 0

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(self._vocab_size, dtype=np.bool_)
        mask[self._ids[min(self._step, len(self._ids) - 1)]] = True
        return mask

    def advance(self, token_id: int) -> None:
        assert token_id == self._ids[self._step], (token_id, self._ids, self._step)
        self._step += 1

    def is_finished(self) -> bool:
        return self._step >= len(self._ids)


class ForcingEngine:
    """A real engine whose grammars (``make_constraint``: tool calls, typed answers) are replaced
    by ``ForcedIds(ids)``; everything else is the engine's. For driving a ``Runtime`` to a chosen
    answer: ``Runtime(ForcingEngine(engine, ids, vocab_size))``."""

    def __init__(self, engine: Any, ids: Sequence[int], vocab_size: int) -> None:
        self._engine, self._ids, self._vocab_size = engine, list(ids), vocab_size

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def make_constraint(self, grammar: str) -> ForcedIds:
        return ForcedIds(self._ids, self._vocab_size)


def vocab_size(family: str) -> int:
    """The width of the family's logits (``config.json``'s ``vocab_size``)."""
    return int(json.loads((ZOO / family / "config.json").read_text(encoding="utf-8"))["vocab_size"])


async def _resume_one(job: dict[str, Any]) -> dict[str, Any]:
    from agentkv import Runtime
    from agentkv.memory import Store

    engine = open_zoo_engine(job["family"])
    store = Store(job["url"])
    runtime = Runtime(engine, store, agents=[restore_agent()])
    try:
        conversation = await runtime.resume(job["conversation_id"])
        report = conversation.resume_report
        assert report is not None  # set by every resume
        result = await runtime.run(conversation, job["text"])
        metrics = result.call_metrics[0]
        return {
            "token_ids": list(result.new_messages[-1].token_ids or ()),
            "restored": report.restored_tokens,
            "prompt": metrics.prompt_tokens,
            "reused": metrics.reused_tokens,
            "prefilled": metrics.prefilled_tokens,
            "kv_exact": metrics.kv_exact,
        }
    finally:
        await runtime.aclose()
        await store.close()
        await engine.aclose()


async def _main(jobs_path: str) -> None:
    report: dict[str, Any] = {}
    for job in json.loads(Path(jobs_path).read_text(encoding="utf-8")):
        try:
            report[job["family"]] = await _resume_one(job)
        except Exception as error:  # reported per family: one broken model must not hide the others
            report[job["family"]] = {"error": f"{type(error).__name__}: {error}"}
    print(json.dumps(report))


if __name__ == "__main__":
    import anyio

    anyio.run(_main, sys.argv[1])
