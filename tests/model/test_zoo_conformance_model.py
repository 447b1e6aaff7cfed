"""Per-family conformance on the model zoo (issue 25), through the public API: exact restore in a
new process, prefix hit, sliding window (shift, or a named fallback), stop tokens.

One paged engine per family (``zoo_helpers.open_zoo_engine``: ``exact=True``, f32 KV, the default
prefix cache, 16 MiB of blocks). What each test states, for every family of tests/data/zoo:

- restore: two turns stored in SQLite, resumed in a new process (one worker process for all
  families, ``zoo_helpers.py``): the third turn's greedy tokens equal an uninterrupted run's, the
  resume brings KV back, and the resumed call reuses and prefills exactly what the uninterrupted
  call did (the history is not re-read; a restore loses nothing the next turn could use).
- prefix hit: the second conversation of an agent with a long system prompt reads the cached
  prefix — at least the whole system text — and answers as a conversation with no cached prefix
  (another tenant salt: a cold prefill). Gemma 2 and 3 merge the system prompt into the first
  user turn: the registered prefix runs to that turn's content (issue 25 item 10).
- sliding window: a conversation pushed past ``max_prompt_len`` either drops spans and shifts the
  KV (RoPE) or falls back to truncation with a reason; either way the next call reuses all the KV
  the prompt still renders, its KV is then the rendered prompt's (the KV invariant), and the
  conversation goes on; a shift keeps all the kept messages' KV in place. Every family shifts
  (Phi-3.5 rotates part of each head, Gemma 3 has a θ per layer: issue 25 item 8).
- stop tokens (tests/model/test_own_model_tools.py has the EOS set and a generation stopping on each
  ``generation_config.json`` EOS): a run whose answer is forced to ``{}`` + one of those EOS ids
  (``zoo_helpers.ForcingEngine`` replaces the grammar of the agent's ``output_type`` with fixed ids:
  random weights never pick an EOS) stops there; the EOS is not in the text (the stored message's
  ids keep it), and the next turn reuses all the KV. Streaming stops on each of them with no text;
  ``ignore_eos`` ignores all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from zoo_helpers import (
    FAMILIES,
    RESTORE_TURNS,
    ZOO,
    ForcedIds,
    ForcingEngine,
    common_len,
    generation_eos,
    open_zoo_engine,
    restore_agent,
    text_end,
    vocab_size,
)

from agentkv import Agent, ContextCompacted, GenerationConfig, ModelCallFinished, Runtime
from agentkv.memory import Store
from agentkv.policies import SlidingWindow

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]
WORKER = str(Path(__file__).with_name("zoo_helpers.py"))
BLOCK = 32
"""Tokens per KV block of the paged engine."""

_ENGINES: dict[str, Any] = {}


def _engine(family: str) -> Any:
    """One engine per family for the whole module."""
    if family not in _ENGINES:
        _ENGINES[family] = open_zoo_engine(family)
    return _ENGINES[family]


def test_every_family_of_the_zoo_is_checked() -> None:
    assert set(FAMILIES) >= {"qwen2_5", "qwen3", "llama3_1", "phi3_5", "gemma2", "gemma3", "mistral_nemo"}


# ---- 1. exact restore in a new process ---------------------------------------------------------

async def _turns(runtime: Runtime, conversation: Any, turns: tuple[str, ...]) -> list[Any]:
    return [await runtime.run(conversation, text) for text in turns]


async def _restore_case(family: str, directory: Path) -> dict[str, Any]:
    """Three uninterrupted turns in memory; the same first two turns stored in SQLite."""
    agent = restore_agent()
    runtime = Runtime(_engine(family))
    try:
        conversation = await runtime.open_conversation(agent)
        first_two = await _turns(runtime, conversation, RESTORE_TURNS[:2])
        held = len(conversation.kv.tokens)
        (third,) = await _turns(runtime, conversation, RESTORE_TURNS[2:])
    finally:
        await runtime.aclose()
    directory.mkdir()
    url = f"sqlite:///{directory / 'agentkv.db'}"
    async with Store(url) as store:
        runtime = Runtime(_engine(family), store, agents=[agent])
        try:
            opened = await runtime.open_conversation(agent, conversation_id=family)
            stored = await _turns(runtime, opened, RESTORE_TURNS[:2])
        finally:
            await runtime.aclose()
    answers = [list(r.new_messages[-1].token_ids or ()) for r in [*first_two, third]]
    return {"answers": answers, "stored": [list(r.new_messages[-1].token_ids or ()) for r in stored],
            "held": held, "third": third.call_metrics[0],
            "job": {"family": family, "url": url, "conversation_id": family, "text": RESTORE_TURNS[2]}}


@pytest.fixture(scope="module")
async def restored(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Per family: the uninterrupted run, the stored run and what the worker process reported."""
    base = tmp_path_factory.mktemp("zoo-restore")
    cases: dict[str, dict[str, Any]] = {}
    for family in FAMILIES:
        try:
            cases[family] = await _restore_case(family, base / family)
        except Exception as error:  # reported by that family's test: one broken model must not hide the others
            cases[family] = {"error": f"{type(error).__name__}: {error}"}
    jobs = base / "jobs.json"
    jobs.write_text(json.dumps([case["job"] for case in cases.values() if "job" in case]), encoding="utf-8")
    done = subprocess.run([sys.executable, WORKER, str(jobs)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    for family, case in cases.items():
        case["resumed"] = report.get(family, {"error": "not resumed"})
    return cases


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_resumed_in_a_new_process_answers_as_the_uninterrupted_one(
    family: str, restored: dict[str, dict[str, Any]]
) -> None:
    case = restored[family]
    assert "error" not in case, case["error"]
    resumed = case["resumed"]
    assert "error" not in resumed, resumed
    assert case["stored"] == case["answers"][:2]  # the stored turns are the uninterrupted ones
    assert resumed["token_ids"] == case["answers"][2]
    # the snapshot brought KV back (at most what the uninterrupted conversation held)...
    assert 0 < resumed["restored"] <= case["held"] and resumed["kv_exact"]
    # ...and the resumed call reused and prefilled what the uninterrupted call did: no re-read history
    third = case["third"]
    assert (resumed["prompt"], resumed["reused"], resumed["prefilled"]) == (
        third.prompt_tokens, third.reused_tokens, third.prefilled_tokens)


# ---- 2. prefix hit -----------------------------------------------------------------------------

SYSTEM = ("You are the support agent of a parcel company. Answer in one sentence, be polite, never invent "
          "tracking numbers, and ask for the order id when it is missing. Mention the opening hours of the "
          "depot only when the customer asks to collect a parcel in person.")
QUESTIONS = ("Where is my parcel?", "How much is express delivery?")
async def _first_turn(runtime: Runtime, agent: Agent, question: str, salt: str) -> tuple[Any, list[int], list[int]]:
    """(metrics, prompt ids, answer ids) of a new conversation's first turn."""
    conversation = await runtime.open_conversation(agent, salt=salt)
    result = await runtime.run(conversation, question)
    metrics = result.call_metrics[0]
    return metrics, list(conversation.kv.tokens[: metrics.prompt_tokens]), list(result.new_messages[-1].token_ids or ())


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_second_conversation_hits_the_cached_system_prompt_and_answers_as_a_cold_one(family: str) -> None:
    engine = _engine(family)
    agent = Agent(name="zoo-prefix", instructions=SYSTEM, generation=GenerationConfig(max_new_tokens=8))
    runtime = Runtime(engine)
    try:
        first, first_prompt, _ = await _first_turn(runtime, agent, QUESTIONS[0], "zoo-hit")
        hit, prompt, answer = await _first_turn(runtime, agent, QUESTIONS[1], "zoo-hit")
        cold, cold_prompt, cold_answer = await _first_turn(runtime, agent, QUESTIONS[1], "zoo-cold")
    finally:
        await runtime.aclose()
    assert first.prefix_cache_tokens == 0 and cold.prefix_cache_tokens == 0  # first of their tenant
    assert cold_prompt == prompt
    system_end = text_end(engine.tokenizer.decode, prompt, SYSTEM)
    assert system_end >= 2 * BLOCK  # the system text spans at least two KV blocks
    # the hit covers the whole system text (its last token may merge with what follows it) and
    # nothing the two conversations do not share
    assert system_end - 1 <= hit.prefix_cache_tokens <= common_len(first_prompt, prompt), (
        family, hit.prefix_cache_tokens, system_end)
    assert hit.prefilled_tokens == hit.prompt_tokens - hit.prefix_cache_tokens and hit.kv_exact
    assert answer == cold_answer


# ---- 3. sliding window -------------------------------------------------------------------------

WINDOW_QUESTIONS = (
    "Where is my parcel? It was sent last week from Leeds.", "Can I change the delivery address to my office?",
    "How much does express delivery cost for a small box?", "Do you ship abroad, for example to France or Spain?",
    "What happens if nobody is at home when the driver comes?", "Can I pick the parcel up at a depot instead?",
    "Thank you, that is all for today.",
)
WINDOW_LIMIT, WINDOW_RESPONSE = 200, 16
SYSTEM_PROMPT_MOVES = {"gemma2", "gemma3", "mistral_nemo"}
"""Templates that render the system prompt inside the first (Gemma) or the last (Mistral Nemo) user
turn: once rendered exactly, dropping old messages changes how the kept ones render."""
_WINDOW_RUNS: dict[str, dict[str, Any]] = {}


async def _window_run(family: str) -> dict[str, Any]:
    """One conversation per family across the window limit until it compacted twice (run once,
    read by two tests)."""
    if family in _WINDOW_RUNS:
        return _WINDOW_RUNS[family]
    agent = Agent(name="zoo-window", instructions="You are a terse support agent for a parcel company.",
                  policy=SlidingWindow(), max_prompt_len=WINDOW_LIMIT, min_response_len=WINDOW_RESPONSE,
                  generation=GenerationConfig(max_new_tokens=12))
    runtime = Runtime(_engine(family))
    run: dict[str, Any] = {"events": [], "calls": [], "turns": 0, "answers": 0}
    try:
        conversation = await runtime.open_conversation(agent)
        for question in WINDOW_QUESTIONS * 2:
            if len(run["events"]) >= 2 and run["turns"] >= len(WINDOW_QUESTIONS):
                break  # a second round only until the conversation compacted twice
            pending: dict[str, Any] | None = None
            async for event in runtime.run_stream(conversation, question):
                if isinstance(event, ContextCompacted):
                    kv, rendered = conversation.kv.tokens, conversation.render(agent).token_ids
                    pending = {"event": event, "kv": len(kv), "aligned": common_len(kv, rendered), "prompt": rendered}
                    run["events"].append(pending)
                elif isinstance(event, ModelCallFinished):
                    run["calls"].append(event.metrics)
                    if pending is not None:  # the call that read the compacted prompt
                        pending["next"] = event.metrics
                        pending["kv_of_prompt"] = conversation.kv.tokens[: len(pending["prompt"])]
                        pending = None
            run["answers"] += conversation.messages[-1].role == "assistant"
            run["turns"] += 1
        run["shifted"] = conversation.kv.shifted
    finally:
        await runtime.aclose()
    _WINDOW_RUNS[family] = run
    return run


@pytest.mark.parametrize("family", FAMILIES)
async def test_the_sliding_window_shifts_or_names_its_fallback_and_the_conversation_goes_on(family: str) -> None:
    run = await _window_run(family)
    events = [c["event"] for c in run["events"]]
    assert len(events) >= 2 and all(e.policy == "sliding_window" for e in events)
    for e in events:  # a shift, or truncation with the reason it could not shift
        assert e.fallback is None or (e.fallback == "truncation" and e.fallback_reason), e
    assert len({e.fallback for e in events}) == 1  # the model shifts always or never
    assert run["shifted"] == (events[0].fallback is None)
    for compaction in run["events"]:
        # the next call reads the compacted prompt, reusing all the KV the compaction left that
        # the prompt still renders (with a prefix-stable rendering, all of it: see the test below)...
        assert compaction["next"].prompt_tokens == len(compaction["prompt"])
        assert compaction["next"].reused_tokens == compaction["aligned"], compaction
        # ...and then its KV is the rendered prompt's (the KV invariant)
        assert compaction["kv_of_prompt"] == compaction["prompt"]
    assert run["answers"] == run["turns"]
    assert max(m.prompt_tokens for m in run["calls"]) <= WINDOW_LIMIT - WINDOW_RESPONSE


@pytest.mark.parametrize("family", FAMILIES)
async def test_the_sliding_window_drops_spans_from_the_kv_without_falling_back(family: str) -> None:
    run = await _window_run(family)
    assert [c["event"].fallback_reason for c in run["events"]] == [None] * len(run["events"])
    assert run["shifted"]
    # the kept messages' KV stays in place, shifted: with a template that renders each message
    # alone, all of it is still a prefix of the prompt
    if family not in SYSTEM_PROMPT_MOVES:
        assert all(c["aligned"] == c["kv"] > 0 for c in run["events"]), run["events"]


# ---- 4. stop tokens ----------------------------------------------------------------------------

EMPTY_OBJECT = {"type": "object", "properties": {}, "additionalProperties": False}


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_run_ends_on_each_generation_config_eos_and_the_next_turn_reuses_its_kv(family: str) -> None:
    """The answer is forced to ``{}`` then one EOS of ``generation_config.json`` (the random weights
    never choose one): the run stops there, the EOS stays out of the text (the stored message's ids
    keep it, as the model wrote them), and the next turn renders the family's end-of-turn markup
    and reuses all the KV."""
    engine = _engine(family)
    answer = engine.tokenizer.encode("{}")
    agent = Agent(name="zoo-stop", instructions=None, output_type=EMPTY_OBJECT,
                  generation=GenerationConfig(max_new_tokens=12))
    for eos in generation_eos(family):
        # after the EOS the answer would go on: only a stop there ends it at len(answer) + 1 tokens
        runtime = Runtime(ForcingEngine(engine, [*answer, eos, *answer], vocab_size(family)))
        try:
            conversation = await runtime.open_conversation(agent)
            result = await runtime.run(conversation, "Give me an empty object.")
            held = conversation.kv.tokens
            again = await runtime.run(conversation, "Once more.")
        finally:
            await runtime.aclose()
        assert (result.finish_reason, result.final_text, result.output) == ("stop", "{}", {}), (family, eos)
        assert result.call_metrics[0].generated_tokens == len(answer) + 1  # stopped at the EOS
        assert result.new_messages[-1].token_ids == (*answer, eos)  # what the model wrote, its EOS included
        prompt_len = result.call_metrics[0].prompt_tokens
        assert held[prompt_len:prompt_len + len(answer)] == tuple(answer)  # the KV kept the whole answer
        assert again.call_metrics[0].reused_tokens == len(held) and again.cache_breaks == (None,)


@pytest.mark.parametrize("family", FAMILIES)
async def test_each_generation_config_eos_stops_a_stream_silently_unless_eos_is_ignored(family: str) -> None:
    engine = _engine(family)
    prompt = json.loads((ZOO / family / "reference.json").read_text(encoding="utf-8"))["prompt_ids"]
    session = await engine.open_session()
    try:
        for eos in generation_eos(family):
            stream = session.stream(prompt, GenerationConfig(max_new_tokens=3),
                                    constraint=ForcedIds([eos] * 3, vocab_size(family)))
            texts = [delta.text async for delta in stream]
            assert stream.result is not None
            assert (stream.result.finish_reason, list(stream.result.token_ids), "".join(texts)) == ("stop", [eos], "")
            ignored = await session.generate(prompt, GenerationConfig(max_new_tokens=2, ignore_eos=True),
                                             constraint=ForcedIds([eos] * 3, vocab_size(family)))
            assert (ignored.finish_reason, list(ignored.token_ids)) == ("length", [eos, eos]), (family, eos)
    finally:
        await session.close()
