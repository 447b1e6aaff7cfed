"""Prefix cache: TTFT of new sessions that share a ~1,000-token system prompt, cold vs cached.

Eight new sessions, each with the same system prompt (+ tool-like rules) and its own short
question, answered once with the prefix cache off (every session prefills everything) and
once with it on (the first agent reads the prompt and the cache captures it; the eight new
sessions reuse its KV and prefill only their question). On the stateful engine a hit copies the
cached KV into the session's request; on the paged engine it points the session's block table at
the cached blocks (no copy). The last line is one JSON object.
Run: ``python benchmarks/prefix.py [--engine both|paged|stateful]``.
"""

from __future__ import annotations

import argparse
import statistics

import anyio

from agentkv.engine.base import GenerationConfig
from agentkv.engine.factory import open_engine
from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result

RULES = [
    "Always greet the customer by name when the name is known.",
    "Never reveal internal tracking codes; give the public tracking link instead.",
    "When a parcel is late by more than three days, offer a refund of the shipping fee.",
    "Escalate to a human agent if the customer mentions a legal complaint.",
    "Summarise the customer's problem in one sentence before proposing a solution.",
    "Use metric units and the customer's local time zone in every answer.",
    "Tool lookup_order(order_id: str) returns status, carrier and expected delivery date.",
    "Tool refund(order_id: str, amount_eur: float, reason: str) issues a refund and returns its id.",
]
QUESTIONS = [
    "Where is my parcel 4411?", "Can I change my delivery address?", "Why was I charged twice?",
    "Do you deliver on Sundays?", "My parcel arrived damaged.", "How do I return a jacket?",
    "Is express delivery available to Norway?", "Can I pick up my order at a locker?",
]


def system_prompt(engine: StatefulEngine, target: int) -> str:
    """Support-agent instructions of about ``target`` tokens."""
    lines = ["You are the support agent of Parcelo, a European parcel company."]
    i = 0
    while len(engine.tokenizer.encode("\n".join(lines))) < target:
        lines.append(f"Rule {i + 1}. {RULES[i % len(RULES)]}")
        i += 1
    return "\n".join(lines)


def render(engine: StatefulEngine, system: str, question: str) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


async def ttft(engine: StatefulEngine, prompt: list[int]) -> tuple[float, int, int]:
    """(TTFT, prefix-cache tokens, prefilled tokens) of one new session's first token."""
    session = await engine.open_session()
    result = await session.generate(prompt, GenerationConfig(max_new_tokens=1))
    await session.close()
    m = result.metrics
    return m.ttft_s, m.prefix_cache_tokens, m.prefilled_tokens


async def measure(target: int, sessions: int, backend: str) -> dict[str, float]:
    engine = open_engine(backend=backend, num_slots=2)  # type: ignore[arg-type]
    print(f"--- {type(engine).__name__}")
    system = system_prompt(engine, target)
    questions = ["Hello, who are you?"] + [QUESTIONS[i % len(QUESTIONS)] + f" (case {i})" for i in range(sessions)]
    prompts = [render(engine, system, q) for q in questions]
    shared = min(next(i for i, (a, b) in enumerate(zip(prompts[0], p)) if a != b) for p in prompts[1:])
    print(f"system prompt + template: {shared} tokens; prompts {len(prompts[1])}..{max(map(len, prompts))} tokens")
    await ttft(engine, prompts[0])  # warm-up (first inference allocates)
    cache = engine.prefix_cache
    engine.backend.prefix_cache = None
    cold = [await ttft(engine, p) for p in prompts[1:]]
    engine.backend.prefix_cache = cache
    engine.register_prefix(prompts[0][:shared])
    first = await ttft(engine, prompts[0])  # the first agent reads the prompt; the cache captures it
    cached = [await ttft(engine, p) for p in prompts[1:]]
    print(f"{'session':>8} {'cold TTFT ms':>13} {'cached TTFT ms':>15} {'from cache':>11} {'prefilled':>10}")
    for i, (c, h) in enumerate(zip(cold, cached), start=1):
        print(f"{i:8d} {c[0] * 1000:13.1f} {h[0] * 1000:15.1f} {h[1]:11d} {h[2]:10d}")
    print(f"first agent (capture included): {first[0] * 1000:.1f} ms; cache stats: {engine.prefix_cache.stats()}")
    await engine.aclose()
    cold_ms, cached_ms = statistics.median(c[0] for c in cold), statistics.median(h[0] for h in cached)
    print(f"median TTFT: cold {cold_ms * 1000:.1f} ms, cached {cached_ms * 1000:.1f} ms")
    return {"cold_over_cached_ttft": cold_ms / cached_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--engine", choices=["both", "paged", "stateful"], default="both")
    args = parser.parse_args()
    backends = ["stateful", "paged"] if args.engine == "both" else [args.engine]
    result = {}
    for backend in backends:
        figures = anyio.run(measure, args.system_tokens, args.sessions, backend)
        result.update({f"{k}_{backend}": v for k, v in figures.items()})
    print_result(__file__, {k: round(v, 2) for k, v in result.items()})


if __name__ == "__main__":
    main()
