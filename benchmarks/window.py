"""Context-window policies at max_prompt_len=1024: Truncation vs SlidingWindow vs SummarizeAndReprefill.

The same 40-turn conversation (~100-token user turns, 48-token answers) runs once per policy
on the default model (its default u8 KV cache). Per policy it prints total time, mean and max
TTFT (the model call's, and as the user sees it: compaction + TTFT), the number of
compactions and their cost. Up to the first compaction the runs are identical (greedy), so
the first compactions compare the policies at the same point. The last line is one JSON
object. Run: ``python benchmarks/window.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import anyio
from _turns import padded_turn

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.engine.stateful import StatefulEngine
from agentkv.events import ContextCompacted, StepFinished
from agentkv.policies import SlidingWindow, SummarizeAndReprefill, Truncation

POLICIES = {"truncation": Truncation, "sliding_window": SlidingWindow, "summarize_and_reprefill": SummarizeAndReprefill}


def user_turn(engine: StatefulEngine, turn: int, target: int = 100) -> str:
    return padded_turn(engine.tokenizer.encode, f"Note {turn}.", " What should I remember from this?",
                       start=turn, step=3, target=target)


async def run_policy(engine: StatefulEngine, name: str, turns: int, max_prompt_len: int) -> dict:
    agent = Agent(
        name=f"bench-{name}",
        instructions="You are a note-taking assistant. Answer briefly.",
        policy=POLICIES[name](),
        max_prompt_len=max_prompt_len,
        min_response_len=64,
        generation=GenerationConfig(max_new_tokens=48, ignore_eos=True),
    )
    runtime = Runtime(engine)
    session = await runtime.open_session(agent)
    ttfts, seen_ttfts, costs, prompts = [], [], [], []
    started = time.perf_counter()
    for turn in range(1, turns + 1):
        pending_cost = 0.0
        async for event in runtime.run_stream(session, user_turn(engine, turn)):
            if isinstance(event, ContextCompacted):
                costs.append(event.cost_ms)
                pending_cost += event.cost_ms / 1000
                print(f"  turn {turn:2d}: {event.policy} {event.tokens_before} → {event.tokens_after} tokens, "
                      f"{event.messages_removed} messages, {event.cost_ms:7.1f} ms", flush=True)
            elif isinstance(event, StepFinished):
                ttfts.append(event.metrics.ttft_s)
                seen_ttfts.append(event.metrics.ttft_s + pending_cost)
                prompts.append(event.metrics.prompt_tokens)
                pending_cost = 0.0
    total = time.perf_counter() - started
    await runtime.aclose()
    return {"total_s": total, "ttft": ttfts, "seen_ttft": seen_ttfts, "costs_ms": costs, "prompts": prompts}


def report(name: str, data: dict) -> None:
    costs = data["costs_ms"] or [0.0]
    print(
        f"{name:24s} total {data['total_s']:6.1f} s | TTFT mean {statistics.mean(data['ttft']) * 1000:6.1f} ms "
        f"max {max(data['ttft']) * 1000:6.1f} ms | with compaction mean "
        f"{statistics.mean(data['seen_ttft']) * 1000:6.1f} ms max {max(data['seen_ttft']) * 1000:7.1f} ms | "
        f"{len(data['costs_ms'])} compactions, cost mean {statistics.mean(costs):7.1f} ms "
        f"max {max(costs):7.1f} ms | max prompt {max(data['prompts'])} tokens",
        flush=True,
    )


async def measure(turns: int, max_prompt_len: int) -> dict[str, dict]:
    engine = StatefulEngine(num_slots=2)
    started = time.perf_counter()
    convention = await engine.rope_convention()  # one-time per engine; not a compaction cost
    print(f"RoPE measured in {(time.perf_counter() - started) * 1000:.0f} ms: {convention}")
    print(f"plugin numerics: {engine.numerics}")
    results = {}
    for name in POLICIES:
        print(f"{name}:", flush=True)
        results[name] = await run_policy(engine, name, turns, max_prompt_len)
    await engine.aclose()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=40)
    parser.add_argument("--max-prompt-len", type=int, default=1024)
    args = parser.parse_args()
    results = anyio.run(measure, args.turns, args.max_prompt_len)
    for name, data in results.items():
        report(name, data)
    truncation, sliding = results["truncation"]["costs_ms"], results["sliding_window"]["costs_ms"]
    if truncation and sliding:
        print(f"first compaction (same point): truncation {truncation[0]:.1f} ms, sliding {sliding[0]:.1f} ms, "
              f"ratio {truncation[0] / sliding[0]:.1f}x")
    summary = {
        "truncation_over_sliding_compaction": round(statistics.mean(truncation) / statistics.mean(sliding), 2)
        if truncation and sliding
        else None,
        "max_prompt_tokens_seen": max(max(d["prompts"]) for d in results.values()),
        "compactions": {name: len(d["costs_ms"]) for name, d in results.items()},
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
