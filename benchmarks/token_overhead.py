"""Per-token overhead of plain decoding: wall time per token less the model's own time.

One session of the paged engine decodes greedy answers (drafts off, ``ignore_eos``). Two clocks
run inside the same call, so the overhead is measured whatever the machine's speed: the time
inside the decode graph's infer calls (``infer``, or ``start_async`` to the end of ``wait``: the
compiled model itself, what openvino-genai's C++ loop adds almost nothing to), and the step
batcher's record of each step (infer plus the step's Python: inputs, logits). ``overhead = TPOT -
infer time per token`` is everything agentkv's Python costs a token; ``gap = TPOT - step time``
the part between steps. Four ways side by side, interleaved (odd repeats backwards): the
decode loop in one worker thread with runs of one-token steps (the default,
``GenerationConfig.decode_run``), the same loop one
token per feed (``decode_run=1``), the loop stepped from the event loop (one thread hop per feed),
and a bare loop calling ``KVLog.feed`` and ``argmax`` in a thread (no decode loop at all). Last
line: JSON with the medians.
Run: ``.venv/bin/python benchmarks/token_overhead.py [--tokens 160] [--repeats 5] [--history 2000]``
(``--history``: the prompt padded to that many tokens of KV).
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.engine.paged.engine import PagedEngine
from agentkv.engine.paged.slot import PagedSlot
from agentkv.kv.log import KVLog
from _results import print_result

PROMPT = "Write a long story about a cat who travels around the world and meets many friends."


class InferClock:
    """Seconds spent inside the decode graph's infer calls, and how many."""

    def __init__(self) -> None:
        self.seconds, self.calls = 0.0, 0


class TimedRequest:
    """An ``InferRequest`` stand-in that adds up the seconds spent inside ``infer`` (and between
    ``start_async`` and the end of ``wait``) on a shared clock."""

    def __init__(self, request: object, clock: InferClock) -> None:
        self._request, self.clock, self._started = request, clock, 0.0

    def infer(self, *args: object, **kwargs: object) -> object:
        started = time.perf_counter()
        try:
            return self._request.infer(*args, **kwargs)  # type: ignore[attr-defined]
        finally:
            self.clock.seconds += time.perf_counter() - started
            self.clock.calls += 1

    def start_async(self, *args: object, **kwargs: object) -> object:
        self._started = time.perf_counter()
        return self._request.start_async(*args, **kwargs)  # type: ignore[attr-defined]

    def wait(self) -> object:
        try:
            return self._request.wait()  # type: ignore[attr-defined]
        finally:
            self.clock.seconds += time.perf_counter() - self._started
            self.clock.calls += 1

    def __getattr__(self, name: str) -> object:
        return getattr(self._request, name)


def timed(engine: PagedEngine) -> InferClock:
    """The clock of the engine's decode-graph requests (batched steps and one-token runs), from now on."""
    model = engine.paged_model
    # NOTE: a benchmark reads the decode graph's own clock
    graphs = [model._decode_request, model._alone_request]  # noqa: SLF001
    timed_ones = [g.request for g in graphs if isinstance(g.request, TimedRequest)]
    clock = timed_ones[0].clock if timed_ones else InferClock()
    for graph in graphs:
        if not isinstance(graph.request, TimedRequest):
            graph.request = TimedRequest(graph.request, clock)  # type: ignore[assignment]
    clock.seconds, clock.calls = 0.0, 0
    return clock


def step_seconds(engine: PagedEngine, since: float) -> list[float]:
    """The one-token steps that ended after ``since`` (the call's decode steps)."""
    return [r.seconds for r in engine.batcher.recent_steps() if r.ended_at > since and r.tokens == 1]


async def engine_round(engine: PagedEngine, prompt: list[int], tokens: int, *, threaded: bool,
                       run: int = GenerationConfig().decode_run) -> dict[str, float]:
    """One generation through the session API; the backend's driver switched for this round."""
    engine.backend.decodes_in_thread = threaded  # type: ignore[misc]  # an instance flag for the comparison
    session = await engine.open_session()
    try:
        await session.prefill(prompt)
        since = time.perf_counter()
        clock = timed(engine)
        main_cpu = time.thread_time()
        result = await session.generate(prompt, GenerationConfig(max_new_tokens=tokens, ignore_eos=True,
                                                                 prompt_lookup=False, decode_run=run))
        main_cpu = time.thread_time() - main_cpu
    finally:
        await session.close()
    return {**figures(result.metrics.tpot_s, step_seconds(engine, since), clock),
            "event_loop_cpu_ms": main_cpu / tokens * 1e3}


def figures(tpot: float, steps: list[float], clock: InferClock) -> dict[str, float]:
    """Milliseconds per token: TPOT, the mean step and infer, the gap between steps, the overhead."""
    infer = clock.seconds / clock.calls
    return {"tpot_ms": tpot * 1e3, "step_ms": statistics.fmean(steps) * 1e3, "infer_ms": infer * 1e3,
            "gap_ms": (tpot - statistics.fmean(steps)) * 1e3, "overhead_ms": (tpot - infer) * 1e3}


async def bare_round(engine: PagedEngine, prompt: list[int], tokens: int) -> dict[str, float]:
    """``KVLog.feed`` + ``argmax`` per token in one thread, through the same batcher."""
    slot, log = PagedSlot(engine.paged_model, engine.block_pool, engine.batcher), KVLog()

    def decode() -> tuple[float, float]:
        logits = log.feed(slot, prompt)
        timed(engine)
        since = started = time.perf_counter()
        token = int(np.argmax(logits))
        for _ in range(tokens - 1):
            token = int(np.argmax(log.feed(slot, [token])))
        return (time.perf_counter() - started) / (tokens - 1), since

    try:
        tpot, since = await anyio.to_thread.run_sync(decode)
    finally:
        slot.reset()
    clock = engine.paged_model._decode_request.request.clock  # type: ignore[attr-defined]  # noqa: SLF001
    return figures(tpot, step_seconds(engine, since), clock)


async def measure(tokens: int, repeats: int, history: int) -> dict:
    engine = PagedEngine(num_slots=2)
    engine.paged_model.wait_for_graphs()  # measured on every graph, none compiling beside it
    prompt = list(engine.tokenizer.encode(PROMPT))
    while len(prompt) < history:
        prompt += prompt
    prompt = prompt[:max(history, 1)] if history else prompt
    rounds: dict[str, list[dict[str, float]]] = {"thread": [], "one_by_one": [], "event_loop": [], "bare": []}
    try:
        await engine_round(engine, prompt, 16, threaded=True)  # warm-up
        ways = {"thread": lambda: engine_round(engine, prompt, tokens, threaded=True),
                "one_by_one": lambda: engine_round(engine, prompt, tokens, threaded=True, run=1),
                "event_loop": lambda: engine_round(engine, prompt, tokens, threaded=False),
                "bare": lambda: bare_round(engine, prompt, tokens)}
        names = list(ways)
        for repeat in range(repeats):
            # NOTE: odd repeats run backwards, so no way always follows the same one: runs in the thread
            # measured ~0.1 ms a token more in the round right after the bare loop's (0.31 vs 0.20 ms,
            # one process), where a fixed order (or one rotated, which keeps its neighbours) put them
            for name in (names if repeat % 2 == 0 else names[::-1]):
                rounds[name].append(await ways[name]())
            line = "  ".join(f"{name} {r[-1]['tpot_ms']:6.2f} ms/tok (overhead {r[-1]['overhead_ms']:5.3f}, "
                             f"gap {r[-1]['gap_ms']:5.3f})" for name, r in rounds.items())
            print(f"repeat {repeat + 1}: {line}", flush=True)
    finally:
        await engine.aclose()
    return {name: {key: statistics.median(r[key] for r in runs) for key in runs[0]} for name, runs in rounds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--history", type=int, default=0)
    args = parser.parse_args()
    medians = anyio.run(measure, args.tokens, args.repeats, args.history)
    for name, m in medians.items():
        print(f"{name:10s} " + "  ".join(f"{k} {v:.3f}" for k, v in m.items()))
    print_result(__file__, {
        "overhead_ms_thread": round(medians["thread"]["overhead_ms"], 3),
        "overhead_ms_one_by_one": round(medians["one_by_one"]["overhead_ms"], 3),
        "overhead_ms_event_loop": round(medians["event_loop"]["overhead_ms"], 3),
        "overhead_ms_bare": round(medians["bare"]["overhead_ms"], 3),
        "gap_ms_thread": round(medians["thread"]["gap_ms"], 3),
        "gap_ms_event_loop": round(medians["event_loop"]["gap_ms"], 3),
        "gap_ms_bare": round(medians["bare"]["gap_ms"], 3),
        "event_loop_cpu_ms_per_token_thread": round(medians["thread"]["event_loop_cpu_ms"], 3),
        "event_loop_cpu_ms_per_token_event_loop": round(medians["event_loop"]["event_loop_cpu_ms"], 3),
        "tpot_event_loop_over_thread": round(medians["event_loop"]["tpot_ms"] / medians["thread"]["tpot_ms"], 3),
    })


if __name__ == "__main__":
    main()
