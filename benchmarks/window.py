"""Context-window policies at max_prompt_len=1024: Truncation vs SlidingWindow vs SummarizeAndReprefill.

The same conversation (~100-token user turns, 48-token answers) runs once per policy on the
default model and the default engine (paged; ``--engine stateful`` for the stateful one). Per
policy it prints the total time, the model calls' TTFT, the compactions and their cost, and what
a user feels: the latency of a turn that compacts (wall clock from sending the message to its
first token, the compaction included), mean and worst, next to the other turns'. Up to the first
compaction the runs are identical (greedy), so the first compactions compare the policies at the
same point. The last line is one JSON object. Run: ``python benchmarks/window.py [--turns 40]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import anyio
from _turns import padded_turn

from agentkv import Agent, GenerationConfig, Runtime, open_engine
from agentkv.engine.base import Engine
from agentkv.events import ContextCompacted, ModelCallFinished, TextDelta
from agentkv.policies import SlidingWindow, SummarizeAndReprefill, Truncation
from _results import print_result

POLICIES = {"truncation": Truncation, "sliding_window": SlidingWindow, "summarize_and_reprefill": SummarizeAndReprefill}


@dataclass
class PolicyRun:
    """What one policy's conversation measured (seconds unless named ``_ms``)."""

    total_s: float = 0.0
    ttft: list[float] = field(default_factory=list)
    """Each model call's TTFT (the engine's figure)."""
    costs_ms: list[float] = field(default_factory=list)
    """Each compaction's own cost."""
    compacting_turns: list[float] = field(default_factory=list)
    """Wall clock from sending a message to its first token, for the turns that compacted."""
    other_turns: list[float] = field(default_factory=list)
    """The same for the turns that did not."""
    prompts: list[int] = field(default_factory=list)

    def summary(self) -> dict:
        def ms(values: list[float]) -> dict:
            return {"mean": round(statistics.mean(values) * 1000, 1), "max": round(max(values) * 1000, 1)} \
                if values else {"mean": None, "max": None}
        return {"total_s": round(self.total_s, 2), "compactions": len(self.costs_ms),
                "compacting_turn_ms": ms(self.compacting_turns), "other_turn_ms": ms(self.other_turns),
                "compaction_cost_ms": ms([c / 1000 for c in self.costs_ms]),
                "max_prompt_tokens": max(self.prompts)}


def user_turn(engine: Engine, turn: int, target: int = 100) -> str:
    return padded_turn(engine.tokenizer.encode, f"Note {turn}.", " What should I remember from this?",
                       start=turn, step=3, target=target)


async def run_policy(engine: Engine, name: str, turns: int, max_prompt_len: int) -> PolicyRun:
    agent = Agent(
        name=f"bench-{name}",
        instructions="You are a note-taking assistant. Answer briefly.",
        policy=POLICIES[name](),
        max_prompt_len=max_prompt_len,
        min_response_len=64,
        generation=GenerationConfig(max_new_tokens=48, ignore_eos=True),
    )
    runtime = Runtime(engine)
    session = await runtime.open_conversation(agent)
    run = PolicyRun()
    started = time.perf_counter()
    for turn in range(1, turns + 1):
        sent, first_token, compacted = time.perf_counter(), None, False
        async for event in runtime.run_stream(session, user_turn(engine, turn)):
            if isinstance(event, ContextCompacted):
                compacted = True
                run.costs_ms.append(event.cost_ms)
                print(f"  turn {turn:2d}: {event.policy} {event.tokens_before} → {event.tokens_after} tokens, "
                      f"{event.messages_removed} messages, {event.cost_ms:7.1f} ms", flush=True)
            elif isinstance(event, TextDelta) and first_token is None:
                first_token = time.perf_counter() - sent
            elif isinstance(event, ModelCallFinished):
                run.ttft.append(event.metrics.ttft_s)
                run.prompts.append(event.metrics.prompt_tokens)
        # a turn that showed no text (ignore_eos makes that rare) counts until its answer ended
        waited = first_token if first_token is not None else time.perf_counter() - sent
        (run.compacting_turns if compacted else run.other_turns).append(waited)
    run.total_s = time.perf_counter() - started
    await runtime.aclose()
    return run


def report(name: str, run: PolicyRun) -> None:
    s = run.summary()
    turn, other, cost = s["compacting_turn_ms"], s["other_turn_ms"], s["compaction_cost_ms"]
    print(f"{name:24s} total {run.total_s:6.1f} s | turn that compacts: mean {turn['mean']} ms, worst "
          f"{turn['max']} ms (other turns: mean {other['mean']} ms, worst {other['max']} ms) | "
          f"{s['compactions']} compactions, cost mean {cost['mean']} ms, max {cost['max']} ms | "
          f"TTFT mean {statistics.mean(run.ttft) * 1000:.1f} ms | max prompt {s['max_prompt_tokens']} tokens",
          flush=True)


async def measure(backend: str, turns: int, max_prompt_len: int) -> tuple[str, dict[str, PolicyRun]]:
    engine = open_engine(backend=backend, num_slots=2)
    started = time.perf_counter()
    convention = await engine.rope_convention()  # one-time per engine; not a compaction cost
    print(f"engine {type(engine).__name__}; RoPE measured in {(time.perf_counter() - started) * 1000:.0f} ms: "
          f"{convention}; plugin numerics: {getattr(engine, 'numerics', 'n/a')}")
    results = {}
    for name in POLICIES:
        print(f"{name}:", flush=True)
        results[name] = await run_policy(engine, name, turns, max_prompt_len)
    await engine.aclose()
    return type(engine).__name__, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    parser.add_argument("--engine", choices=["paged", "stateful"], default="paged",
                        help="paged (the default engine) or stateful")
    args = parser.parse_args()
    engine, results = anyio.run(measure, args.engine, args.turns, args.max_prompt_len)
    for name, run in results.items():
        report(name, run)
    truncation, sliding = results["truncation"], results["sliding_window"]
    if truncation.costs_ms and sliding.costs_ms:
        print(f"first compaction (same point): truncation {truncation.costs_ms[0]:.1f} ms, sliding "
              f"{sliding.costs_ms[0]:.1f} ms, ratio {truncation.costs_ms[0] / sliding.costs_ms[0]:.1f}x")
    both = truncation.compacting_turns and sliding.compacting_turns
    summary = {
        "engine": engine,
        "turns": args.turns,
        "max_prompt_len": args.max_prompt_len,
        "truncation_over_sliding_compaction": round(statistics.mean(truncation.costs_ms)
                                                    / statistics.mean(sliding.costs_ms), 2) if both else None,
        "truncation_over_sliding_compacting_turn": round(statistics.mean(truncation.compacting_turns)
                                                         / statistics.mean(sliding.compacting_turns), 2)
        if both else None,
        "policies": {name: run.summary() for name, run in results.items()},
    }
    print_result(__file__, summary)


if __name__ == "__main__":
    main()
