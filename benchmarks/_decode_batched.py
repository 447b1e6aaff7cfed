"""The decode benchmark's batched workload (``benchmarks/decode.py --workloads batched``): 8 sessions on
one engine, 4 quoting with drafts off or on beside 4 answering plainly; the others' slowdown."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
from _decode_workloads import CHATS, QUOTE_DOCS, Mode, quote_messages

from agentkv.engine.base import Engine, GenerationConfig


OTHER_PROMPTS = [CHATS[0][0], CHATS[1][0], CHATS[2][0], "Explain how a refrigerator keeps food cold."]
"""Batched: the free-text questions the 4 "others" answer while the quoting sessions run."""


@dataclass
class BatchedRound:
    """One round of the batched workload: the others' tokens in the window when all 8 decode."""

    drafting: bool
    others_tokens: int = 0
    window_s: float = 0.0
    quoting: Mode = field(default_factory=lambda: Mode("quoting"))
    plain_steps: list[float] = field(default_factory=list)
    """Seconds of the window's steps that carried no draft."""
    draft_steps: list[float] = field(default_factory=list)
    """Seconds of the window's steps that carried a draft."""

    @property
    def others_tps(self) -> float:
        return self.others_tokens / self.window_s if self.window_s > 0 else 0.0

    @property
    def step_slowdown(self) -> float | None:
        """The window's step time over what it would be with the drafted steps as long as the
        median plain one: the others' slowdown measured inside the round (the machine's load
        drifts between rounds, not between neighbouring steps); None without a plain step."""
        if not self.plain_steps:
            return None
        plain = statistics.median(self.plain_steps)
        total = sum(self.plain_steps) + sum(self.draft_steps)
        return total / (sum(self.plain_steps) + plain * len(self.draft_steps))


async def batched_round(engine: Engine, others: list[list[int]], quotes: list[list[int]], drafting: bool,
                        max_new: int) -> BatchedRound:
    """4 others answer plainly (until the quoting ends) while 4 sessions quote, drafts ``drafting``."""
    plain = GenerationConfig(max_new_tokens=4 * max_new, prompt_lookup=False, ignore_eos=True)
    quote = GenerationConfig(max_new_tokens=max_new, prompt_lookup=drafting)
    stamps: list[list[float]] = [[] for _ in others]
    first: list[float] = []
    done: list[float] = []
    quoted = anyio.Event()
    out = BatchedRound(drafting)

    async def other(i: int) -> None:
        session = await engine.open_session()
        try:
            async with session.stream(others[i], plain) as stream:
                async for _ in stream:
                    stamps[i].append(time.perf_counter())
                    if len(stamps[i]) == 1:
                        first.append(stamps[i][0])
                    if quoted.is_set():
                        break
        finally:
            await session.close()

    async def quoter(ids: list[int]) -> None:
        session = await engine.open_session()
        try:
            started, tokens = time.perf_counter(), 0
            async with session.stream(ids, quote) as stream:
                async for _ in stream:
                    tokens += 1
                    if tokens == 1:
                        first.append(time.perf_counter())
            assert stream.result is not None
            out.quoting.add(stream.result, time.perf_counter() - started)
            done.append(time.perf_counter())
        finally:
            await session.close()

    async with anyio.create_task_group() as tg:
        for i in range(len(others)):
            tg.start_soon(other, i)
        async with anyio.create_task_group() as quoting_group:
            for ids in quotes:
                quoting_group.start_soon(quoter, ids)
        quoted.set()
    begin, end = max(first), min(done)
    out.window_s = max(0.0, end - begin)
    out.others_tokens = sum(1 for row in stamps for t in row if begin < t <= end)
    batcher = getattr(engine, "batcher", None)  # the paged engine's StepBatcher: its steps one by one
    for record in batcher.recent_steps() if batcher is not None else []:
        if begin < record.ended_at <= end:
            (out.draft_steps if record.drafting else out.plain_steps).append(record.seconds)
    return out


async def batched(engine: Engine, repeats: int, max_new: int = 160) -> list[BatchedRound]:
    """Rounds of the batched workload, drafts off and on alternating (the order flips per repeat)."""
    tok = engine.tokenizer
    others = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True))
              for q in OTHER_PROMPTS]
    quotes = [tok.encode(tok.apply_chat_template(quote_messages(d, a), add_generation_prompt=True))
              for d, a in QUOTE_DOCS]
    await batched_round(engine, others, quotes, True, max_new // 4)  # warm-up
    rounds = []
    for repeat in range(repeats):
        for drafting in ((False, True) if repeat % 2 == 0 else (True, False)):
            rounds.append(await batched_round(engine, others, quotes, drafting, max_new))
            r = rounds[-1]
            print(f"  batched {'drafting' if drafting else 'plain   '}: others {r.others_tps:6.1f} tok/s over "
                  f"{r.window_s:5.1f} s; quoting {r.quoting.decode_tps:6.1f} tok/s per session, "
                  f"{r.quoting.accepted}/{r.quoting.drafted} drafted tokens accepted; steps {len(r.plain_steps)} "
                  f"plain + {len(r.draft_steps)} drafted (median {_ms(r.plain_steps)} / {_ms(r.draft_steps)} ms), "
                  f"in-round slowdown {r.step_slowdown or float('nan'):.3f}", flush=True)
    return rounds


def _ms(seconds: list[float]) -> str:
    return f"{statistics.median(seconds) * 1e3:.0f}" if seconds else "-"


def batched_figures(rounds: list[BatchedRound]) -> dict[str, Any]:
    """Slowdown and speed-up over all rounds (tokens over seconds), and per repeat (the spread)."""
    plain = [r for r in rounds if not r.drafting]
    spec = [r for r in rounds if r.drafting]
    if not plain or not spec:
        return {"batched_others_slowdown": None}

    def others(rs: list[BatchedRound]) -> float:
        return sum(r.others_tokens for r in rs) / max(1e-9, sum(r.window_s for r in rs))

    def quoting(rs: list[BatchedRound]) -> float:
        return sum(r.quoting.decode_tokens for r in rs) / max(1e-9, sum(r.quoting.decode_s for r in rs))

    inside = [x for x in (r.step_slowdown for r in spec) if x is not None]
    pairs = [(a.others_tps / b.others_tps if b.others_tps else 0.0) for a, b in zip(plain, spec)]
    return {
        "batched_others_slowdown": round(others(plain) / others(spec), 3) if others(spec) else None,
        "batched_others_slowdown_per_repeat": [round(x, 3) for x in pairs],
        "batched_others_tps_plain": round(others(plain), 2),
        "batched_others_tps_drafting": round(others(spec), 2),
        "batched_others_slowdown_in_round": round(statistics.median(inside), 3) if inside else None,
        "batched_others_slowdown_in_round_range": [round(min(inside), 3), round(max(inside), 3)] if inside else None,
        "batched_drafted_step_share": round(sum(len(r.draft_steps) for r in spec)
                                            / max(1, sum(len(r.draft_steps) + len(r.plain_steps) for r in spec)), 3),
        "batched_spec_over_plain_quote": round(quoting(spec) / quoting(plain), 3),
        "batched_accepted_quote": f"{sum(r.quoting.accepted for r in spec)}/{sum(r.quoting.drafted for r in spec)}",
    }
