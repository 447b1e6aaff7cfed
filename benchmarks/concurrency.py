"""Concurrent sessions: paged continuous batching vs one session at a time vs openvino-genai's
ContinuousBatchingPipeline.

Each session holds a history of 200–1,500 tokens in its KV (prefilled before timing), then
gets a ~30-token user turn and answers 64 tokens (ignore_eos). Printed per run:

- agentkv paged, the N sessions started together (their decode steps batched) vs the same
  turns run one after another on the same engine: ``batched_over_sequential_8``;
- openvino-genai's ``ContinuousBatchingPipeline`` (prefix caching on, warmed with the
  histories so it too prefills only the new turn) on the same 8 prompts in one ``generate``:
  ``agentkv_over_cb_8`` (its wall time / ours);
- one session decoding alone, paged vs stateful tokens/s: ``single_session_decode_ratio``;
- tokens/s for 1, 2, 4, 8 and 16 sessions together, and the least of N sessions' aggregate over one
  session's alone (N > 1): ``together_over_alone_min`` (target >= 0.95: drafts of sessions quoting at
  once verify in shared steps, ``engine/paged/draft_share.py``).

The last line is one JSON object. Run: ``python benchmarks/concurrency.py [--sessions 1 2 4 8 16]``.
"""

from __future__ import annotations

import argparse
import time

import anyio
import openvino_genai as og
from _turns import SENTENCES, padded_turn

from agentkv.engine.base import GenerationConfig, KVSession
from agentkv.engine.paged.engine import PagedEngine
from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result

ANSWER = 64
CFG = GenerationConfig(max_new_tokens=ANSWER, ignore_eos=True)


def history_text(encode, index: int, count: int) -> str:
    """A user message of 200–1,500 tokens, different per session."""
    target = 200 + (1300 * index) // max(1, count - 1)
    return padded_turn(encode, f"Session {index}.", " Keep this in mind.", start=index, sentences=SENTENCES,
                       target=target)


def chat_text(tokenizer, history: str, question: str | None) -> str:
    messages = [{"role": "system", "content": "You are a concise assistant."}, {"role": "user", "content": history}]
    if question is not None:
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": question}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=question is not None)


QUESTION = "Now summarise what I told you in two short sentences, please, and name the session number."


async def open_sessions(engine: StatefulEngine, count: int) -> tuple[list[KVSession], list[list[int]]]:
    """``count`` sessions holding their histories; the prompts of their next turn."""
    tok = engine.tokenizer
    sessions, prompts = [], []
    for i in range(count):
        history = history_text(tok.encode, i, count)
        session = await engine.open_session()
        await session.prefill(tok.encode(chat_text(tok, history, None)))
        sessions.append(session)
        prompts.append(tok.encode(chat_text(tok, history, QUESTION)))
    return sessions, prompts


async def answer_together(sessions: list[KVSession], prompts: list[list[int]]) -> float:
    """Wall seconds for every session to answer, all started at once; then each session is
    trimmed back to its history (no KV copy), ready for the next measurement."""
    held = [len(s.tokens) for s in sessions]
    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for session, prompt in zip(sessions, prompts):
            tg.start_soon(session.generate, prompt, CFG)
    elapsed = time.perf_counter() - started
    for session, n in zip(sessions, held):
        await session.trim(n)
    return elapsed


async def answer_one_by_one(sessions: list[KVSession], prompts: list[list[int]]) -> float:
    held = [len(s.tokens) for s in sessions]
    started = time.perf_counter()
    for session, prompt in zip(sessions, prompts):
        await session.generate(prompt, CFG)
    elapsed = time.perf_counter() - started
    for session, n in zip(sessions, held):
        await session.trim(n)
    return elapsed


async def single_decode_rate(engine: StatefulEngine) -> float:
    """Decode tokens/s of one session over a ~600-token history."""
    sessions, prompts = await open_sessions(engine, 3)
    config = GenerationConfig(max_new_tokens=128, ignore_eos=True)
    result = await sessions[1].generate(prompts[1], config)
    for session in sessions:
        await session.close()
    return 1.0 / result.metrics.tpot_s


def cb_seconds(ir_dir: str, tokenizer, count: int) -> float:
    """ContinuousBatchingPipeline, prefix caching on, warmed with the histories: wall seconds to
    answer the same ``count`` prompts in one generate."""
    scheduler = og.SchedulerConfig()
    scheduler.enable_prefix_caching = True
    scheduler.cache_size = 2
    pipe = og.ContinuousBatchingPipeline(ir_dir, scheduler, "CPU")
    histories = [history_text(tokenizer.encode, i, count) for i in range(count)]
    warm = og.GenerationConfig()
    warm.max_new_tokens = 1
    pipe.generate([chat_text(tokenizer, h, None) for h in histories], [warm] * count)
    config = og.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = ANSWER, True
    prompts = [chat_text(tokenizer, h, QUESTION) for h in histories]
    other = [chat_text(tokenizer, h, "Say hello.") for h in histories]
    pipe.generate(other, [config] * count)  # warm-up on other questions: batch shapes compiled, no reuse
    started = time.perf_counter()
    pipe.generate(prompts, [config] * count)
    return time.perf_counter() - started


async def measure(counts: list[int]) -> dict:
    paged = PagedEngine(num_slots=max(counts) + 3)
    paged.paged_model.wait_for_graphs()  # measured on every graph, none compiling beside it
    figures: dict = {}
    rates = {}
    for count in counts:
        sessions, prompts = await open_sessions(paged, count)
        await answer_together(sessions, prompts)  # NOTE: warm-up: the plugin compiles each new batch shape once
        before = paged.batcher.stats()
        together = await answer_together(sessions, prompts)
        after = paged.batcher.stats()
        rates[count] = count * ANSWER / together
        steps = after.steps - before.steps
        print(f"{count:>2} sessions together: {together:6.2f} s, {rates[count]:6.1f} tok/s, "
              f"{steps} steps, mean batch {(after.sequences - before.sequences) / steps:.1f}, "
              f"{(after.busy_s - before.busy_s) / together:.0%} of the time in the model")
        if count == 8:
            alone = await answer_one_by_one(sessions, prompts)
            figures["batched_over_sequential_8"] = round(alone / together, 2)
            print(f" 8 sessions one by one:  {alone:6.2f} s → batched/sequential {alone / together:.2f}×")
            cb = cb_seconds(str(paged.files.ir_dir), paged.tokenizer, 8)
            figures["agentkv_over_cb_8"] = round(cb / together, 2)
            print(f" 8 prompts on ContinuousBatchingPipeline: {cb:6.2f} s → agentkv/CB {cb / together:.2f}×")
        for session in sessions:
            await session.close()
    figures["tokens_per_s"] = {str(k): round(v, 1) for k, v in rates.items()}
    if 1 in rates and len(rates) > 1:  # issue 47, item 6: N sessions together keep one alone's rate
        figures["together_over_alone_min"] = round(min(v for k, v in rates.items() if k > 1) / rates[1], 2)
        print(f"aggregate tok/s together over one alone, least over N: {figures['together_over_alone_min']:.2f}")
    paged_rate = await single_decode_rate(paged)
    await paged.aclose()
    stateful = StatefulEngine(num_slots=3)
    stateful_rate = await single_decode_rate(stateful)
    await stateful.aclose()
    figures["single_session_decode_ratio"] = round(paged_rate / stateful_rate, 2)
    print(f"one session decoding: paged {paged_rate:.1f} tok/s, stateful {stateful_rate:.1f} tok/s")
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    args = parser.parse_args()
    counts = sorted(set(args.sessions) | {8})
    print_result(__file__, anyio.run(measure, counts))


if __name__ == "__main__":
    main()
