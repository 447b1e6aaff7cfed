"""Decode speed where agents spend their tokens: agentkv with and without each decoding shortcut.

Workloads on the default model (issue 27): **tool calls** — 20 cases of
``tests/data/function_calling.json`` (every category), each question rendered with its tools,
``tool_choice="required"`` (the runtime's grammar: parallel calls, up to 4), greedy, decoded with
grammar fast-forward off and on, interleaved per case (the order alternates) on fresh sessions of
one engine. Per mode: decode tokens/s (tokens after the first over the time after the first), call
tokens/s (tokens over the whole call, prefill included), model steps per call, forced tokens; and
how many answers are token-for-token equal across the modes; and what the grammar's mask costs a
token (``allowed_mask`` + ``advance``, timed in the plain mode: ``mask_ms_per_token_toolcalls``,
and its share of a plain constrained step, ``mask_share_of_plain_step_toolcalls``; it must stay
well under one). **quoting** — a tool returns a
~200-token document (``QUOTE_DOCS``), the user asks to repeat its key part — and **free text** —
multi-turn chat answers (``CHATS``, each mode continuing its own conversation on one session) —
greedy, prompt-lookup drafts off (``plain``) and on (``drafts``), interleaved the same way;
``--genai`` adds openvino-genai's ``LLMPipeline`` plain and with its prompt lookup
(``prompt_lookup=True``, 5 drafted tokens, 3-grams) on the quoting prompts, as the anchor.
**batched** — 8 sessions at once on the engine: 4 "others" answer free text plainly, 4 quote with
drafts off and on (rounds alternate, same prompts, greedy); the others' decode tokens/s counted
while all 8 decode (from the last first token to the first quote done): ``batched_others_slowdown``
= others' tok/s beside plain quoting / beside drafting quoting (target ≤ 1.05; on a shared machine
the load drifts between rounds, so also ``*_in_round``: the drafting rounds' step time over the same
steps at the median plain step's length), and the quoting sessions' own decode speed-up under load.
**sampled** — quoting and free text again at temperature 0.7, top-p 0.9, seeded (``SAMPLED``):
drafts checked by the speculative rule. The last line is one JSON object (``*_over_plain_*``:
decode tokens/s, on over off).
Run: ``python benchmarks/decode.py [--cases 20] [--max-new-tokens 160] [--repeats 1] [--exact]
[--workloads toolcalls,quote,freetext,sampled,batched] [--genai]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, cast

import anyio
from _decode_batched import BatchedRound, batched, batched_figures
from _decode_workloads import CHATS, QUOTE_DOCS, Mode, quote_messages

from agentkv.chat.toolcalls import tool_call_grammar
from agentkv.engine.base import Engine, GenerationConfig, TokenConstraint
from agentkv.engine.generation import GenerationResult
from _results import print_result

CASES_PATH = Path(__file__).resolve().parents[1] / "tests" / "data" / "function_calling.json"


def tool_call_prompts(engine: Engine, count: int) -> list[tuple[str, list[int], str]]:
    """(case id, prompt ids, grammar) for ``count`` cases taken round-robin across categories."""
    data = json.loads(CASES_PATH.read_text(encoding="utf-8"))
    by_category: dict[str, list[dict[str, Any]]] = {}
    for case in data["cases"]:
        by_category.setdefault(case["category"], []).append(case)
    chosen: list[dict[str, Any]] = []
    while len(chosen) < min(count, len(data["cases"])):
        for queue in by_category.values():
            if queue and len(chosen) < count:
                chosen.append(queue.pop(0))
    prompts = []
    for case in chosen:
        tools = [data["tools"][name] for name in case["tools"]]
        text = engine.tokenizer.apply_chat_template([{"role": "user", "content": case["question"]}],
                                                    add_generation_prompt=True, tools=tools)
        prompts.append((case["id"], engine.tokenizer.encode(text), tool_call_grammar(tools, "required")))
    return prompts


class MaskClock:
    """Wraps each call's grammar constraint and adds up the seconds spent in ``allowed_mask`` and
    ``advance``: what the grammar costs a token (``clock.wrap(engine.make_constraint(grammar))``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.masks = 0

    def wrap(self, inner: TokenConstraint) -> TokenConstraint:
        clock = self

        class Timed:
            def allowed_mask(self) -> Any:
                started = time.perf_counter()
                mask = inner.allowed_mask()
                clock.seconds, clock.masks = clock.seconds + time.perf_counter() - started, clock.masks + 1
                return mask

            def advance(self, token_id: int) -> None:
                started = time.perf_counter()
                inner.advance(token_id)
                clock.seconds += time.perf_counter() - started

            def is_finished(self) -> bool:
                return inner.is_finished()

        return cast(TokenConstraint, Timed())

    @property
    def ms_per_mask(self) -> float:
        return 1e3 * self.seconds / self.masks if self.masks else 0.0


async def one_call(engine: Engine, ids: list[int], grammar: str | None, config: GenerationConfig,
                   clock: MaskClock | None = None) -> tuple[GenerationResult, float]:
    session = await engine.open_session()
    try:
        started = time.perf_counter()
        constraint = engine.make_constraint(grammar) if grammar is not None else None
        if constraint is not None and clock is not None:
            constraint = clock.wrap(constraint)
        result = await session.generate(ids, config, constraint=constraint)
        return result, time.perf_counter() - started
    finally:
        await session.close()


async def tool_calls(engine: Engine, count: int, max_new: int, repeats: int, clock: MaskClock
                     ) -> tuple[Mode, Mode, Mode]:
    """Plain, fast-forward, and fast-forward with prompt-lookup drafts (the defaults), interleaved
    per case (the order rotates); ``clock`` times the grammar's masks in the plain mode (one mask
    per token)."""
    prompts = tool_call_prompts(engine, count)
    off, on, spec = Mode("plain"), Mode("fast-forward"), Mode("ff+drafts")
    configs = {"plain": GenerationConfig(max_new_tokens=max_new, fast_forward=False, prompt_lookup=False),
               "fast-forward": GenerationConfig(max_new_tokens=max_new, prompt_lookup=False),
               "ff+drafts": GenerationConfig(max_new_tokens=max_new)}
    await one_call(engine, prompts[0][1], prompts[0][2], configs["plain"])  # warm-up (compile, caches)
    for repeat in range(repeats):
        for index, (case_id, ids, grammar) in enumerate(prompts):
            shift = (index + repeat) % 3
            for mode in [off, on, spec][shift:] + [off, on, spec][:shift]:
                timed = clock if mode is off else None
                result, seconds = await one_call(engine, ids, grammar, configs[mode.name], timed)
                mode.add(result, seconds)
            print(f"  {case_id:<22} plain {len(off.answers[-1]):>4} tokens, fast-forward {len(on.answers[-1]):>4}, "
                  f"ff+drafts {len(spec.answers[-1]):>4}; equal: {off.answers[-1] == on.answers[-1]}, "
                  f"{off.answers[-1] == spec.answers[-1]}")
    return off, on, spec


SAMPLED: dict[str, Any] = {"temperature": 0.7, "top_p": 0.9, "seed": 7}
"""The sampled workloads' settings (each call seeded alike, drafts off and on)."""


async def quoting(engine: Engine, repeats: int, genai: GenaiQuote | None = None, max_new: int = 160,
                  sampling: dict[str, Any] | None = None) -> dict[str, Mode]:
    """Drafts off and on over ``QUOTE_DOCS`` (and ``LLMPipeline`` plain and with prompt lookup when
    ``genai``), interleaved per prompt (the order rotates): modes by name. ``sampling``: config
    settings for sampled calls (default greedy)."""
    tok = engine.tokenizer
    prompts = [tok.encode(tok.apply_chat_template(quote_messages(d, a), add_generation_prompt=True))
               for d, a in QUOTE_DOCS]
    modes = {name: Mode(name) for name in ["plain", "drafts", *(genai.names if genai else [])]}
    configs = {"plain": GenerationConfig(max_new_tokens=max_new, prompt_lookup=False, **(sampling or {})),
               "drafts": GenerationConfig(max_new_tokens=max_new, **(sampling or {}))}
    await one_call(engine, prompts[0], None, configs["drafts"])  # warm-up
    names = list(modes)
    for repeat in range(repeats):
        for index, ids in enumerate(prompts):
            shift = (index + repeat) % len(names)
            for name in names[shift:] + names[:shift]:
                if name in configs:
                    result, seconds = await one_call(engine, ids, None, configs[name])
                    modes[name].add(result, seconds)
                else:
                    assert genai is not None
                    genai.call(name, index, modes[name], max_new)
            on, off = modes["drafts"], modes["plain"]
            print(f"  quote {index} ({len(ids)} prompt tokens): plain {len(off.answers[-1])} tokens, drafts "
                  f"{len(on.answers[-1])}, {on.accepted}/{on.drafted} accepted so far; equal: "
                  f"{off.answers[-1] == on.answers[-1]}")
    return modes


async def free_text(engine: Engine, repeats: int, max_new: int = 128, sampling: dict[str, Any] | None = None
                    ) -> tuple[Mode, Mode]:
    """Drafts off and on over ``CHATS``: each mode keeps its own conversation on one session
    (``sampling``: as ``quoting``)."""
    off, on = Mode("plain"), Mode("drafts")
    configs = {"plain": GenerationConfig(max_new_tokens=max_new, prompt_lookup=False, **(sampling or {})),
               "drafts": GenerationConfig(max_new_tokens=max_new, **(sampling or {}))}
    tok = engine.tokenizer
    for repeat in range(repeats):
        for index, turns in enumerate(CHATS):
            for mode in ((off, on) if (index + repeat) % 2 == 0 else (on, off)):
                session = await engine.open_session()
                messages = [{"role": "system", "content": "You are a helpful assistant."}]
                try:
                    for turn in turns:
                        messages.append({"role": "user", "content": turn})
                        ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
                        started = time.perf_counter()
                        result = await session.generate(ids, configs[mode.name])
                        mode.add(result, time.perf_counter() - started)
                        messages.append({"role": "assistant", "content": result.text})
                finally:
                    await session.close()
            print(f"  chat {index}: {on.accepted}/{on.drafted} drafted tokens accepted so far; last answers "
                  f"equal: {off.answers[-1] == on.answers[-1]}")
    return off, on


class GenaiQuote:
    """``LLMPipeline`` plain and with its prompt lookup (``prompt_lookup=True``; 5 drafted tokens,
    3-grams) on the quoting prompts; decode tok/s from its ``perf_metrics``."""

    names = ["genai", "genai lookup"]

    def __init__(self) -> None:
        import openvino_genai as og

        from agentkv.engine.openvino.models import resolve_model

        self.og = og
        ir_dir = str(resolve_model(None).model_xml.parent)
        self.pipes = {"genai": og.LLMPipeline(ir_dir, "CPU"),
                      "genai lookup": og.LLMPipeline(ir_dir, "CPU", prompt_lookup=True)}

    def call(self, name: str, index: int, mode: Mode, max_new: int) -> None:
        """Answer quoting prompt ``index`` with pipeline ``name``; add its figures to ``mode``."""
        config = self.og.GenerationConfig()
        config.max_new_tokens = max_new
        if name == "genai lookup":
            config.num_assistant_tokens, config.max_ngram_size = 5, 3
        history = self.og.ChatHistory()
        for message in quote_messages(*QUOTE_DOCS[index]):
            history.append(message)
        started = time.perf_counter()
        out = self.pipes[name].generate(history, config)
        seconds = time.perf_counter() - started
        tpot, tokens = out.perf_metrics.get_tpot().mean / 1000, out.perf_metrics.get_num_generated_tokens()
        mode.tokens += tokens
        mode.decode_tokens += max(0, tokens - 1)
        mode.decode_s += tpot * max(0, tokens - 1)
        mode.call_s += seconds
        mode.calls += 1


def table(rows: list[tuple[str, Mode]]) -> None:
    print(f"{'workload':<12} {'mode':<13} {'calls':>5} {'tokens':>7} {'decode tok/s':>12} {'call tok/s':>10} "
          f"{'steps/call':>10} {'forced':>7} {'saved':>6} {'drafted':>8} {'accepted':>8}")
    for workload, mode in rows:
        print(f"{workload:<12} {mode.name:<13} {mode.calls:>5} {mode.tokens:>7} {mode.decode_tps:>12.1f} "
              f"{mode.call_tps:>10.1f} {mode.steps / max(1, mode.calls):>10.1f} {mode.forced:>7} {mode.saved:>6} "
              f"{mode.drafted:>8} {mode.accepted:>8}")


def ratio(on: Mode | None, off: Mode | None) -> float | None:
    """Decode tokens/s of ``on`` over ``off`` (None when either was not measured)."""
    return round(on.decode_tps / off.decode_tps, 3) if on and off and off.decode_tps else None


async def main(args: argparse.Namespace) -> None:
    from agentkv.engine.factory import open_engine
    from agentkv.engine.paged.engine import PagedEngine

    workloads = set(args.workloads.split(","))
    engine = open_engine(exact=True) if args.exact else open_engine()
    if isinstance(engine, PagedEngine):
        engine.paged_model.wait_for_graphs()  # measured on every graph, none compiling beside it
    rows: list[tuple[str, Mode]] = []
    off = on = spec = Mode("plain")
    clock = MaskClock()
    quote: tuple[Mode, Mode] | None = None
    genai: tuple[Mode, Mode] | None = None
    chat: tuple[Mode, Mode] | None = None
    sampled_quote: tuple[Mode, Mode] | None = None
    sampled_chat: tuple[Mode, Mode] | None = None
    rounds: list[BatchedRound] = []
    try:
        if "toolcalls" in workloads:
            off, on, spec = await tool_calls(engine, args.cases, args.max_new_tokens, args.repeats, clock)
            rows += [("tool calls", off), ("tool calls", on), ("tool calls", spec)]
        if "quote" in workloads:
            modes = await quoting(engine, args.repeats, GenaiQuote() if args.genai else None)
            quote = modes["plain"], modes["drafts"]
            genai = (modes["genai"], modes["genai lookup"]) if args.genai else None
            rows += [("quoting", mode) for mode in modes.values()]
        if "freetext" in workloads:
            chat = await free_text(engine, args.repeats)
            rows += [("free text", chat[0]), ("free text", chat[1])]
        if "sampled" in workloads:
            modes = await quoting(engine, args.repeats, sampling=SAMPLED)
            sampled_quote = modes["plain"], modes["drafts"]
            sampled_chat = await free_text(engine, args.repeats, sampling=SAMPLED)
            rows += [("quote T=.7", sampled_quote[0]), ("quote T=.7", sampled_quote[1]),
                     ("free T=.7", sampled_chat[0]), ("free T=.7", sampled_chat[1])]
        if "batched" in workloads:
            rounds = await batched(engine, args.repeats_batched)
    finally:
        await engine.aclose()
    table(rows)
    equal = sum(a == b for a, b in zip(off.answers, on.answers))

    def equal_answers(pair: tuple[Mode, Mode] | None) -> str | None:
        return f"{sum(a == b for a, b in zip(pair[0].answers, pair[1].answers))}/{pair[0].calls}" if pair else None

    print_result(__file__, {
        "numerics": "exact" if args.exact else "default",
        "toolcall_calls": off.calls,
        "plain_decode_tps_toolcalls": round(off.decode_tps, 2),
        "ff_decode_tps_toolcalls": round(on.decode_tps, 2),
        "ff_over_plain_toolcalls": round(on.decode_tps / off.decode_tps, 3) if off.decode_tps else None,
        "ff_over_plain_call_toolcalls": round(on.call_tps / off.call_tps, 3) if off.call_tps else None,
        "plain_steps_per_call_toolcalls": round(off.steps / max(1, off.calls), 2),
        "ff_steps_per_call_toolcalls": round(on.steps / max(1, on.calls), 2),
        "forced_share_toolcalls": round(on.forced / max(1, on.tokens), 3),
        "equal_answers_toolcalls": f"{equal}/{off.calls}",
        "mask_ms_per_token_toolcalls": round(clock.ms_per_mask, 3),
        "mask_share_of_plain_step_toolcalls": round(clock.ms_per_mask * off.decode_tps / 1e3, 3)
        if off.decode_tps else None,
        "spec_over_plain_toolcalls": ratio(spec, off) if spec.calls else None,
        "equal_answers_spec_toolcalls": equal_answers((off, spec)) if spec.calls else None,
        "spec_over_plain_freetext": ratio(chat[1], chat[0]) if chat else None,
        "spec_over_plain_quote": ratio(quote[1], quote[0]) if quote else None,
        "plain_decode_tps_quote": round(quote[0].decode_tps, 2) if quote else None,
        "spec_decode_tps_quote": round(quote[1].decode_tps, 2) if quote else None,
        "accepted_share_quote": round(quote[1].accepted / max(1, quote[1].drafted), 3) if quote else None,
        "equal_answers_quote": equal_answers(quote),
        "plain_decode_tps_freetext": round(chat[0].decode_tps, 2) if chat else None,
        "spec_decode_tps_freetext": round(chat[1].decode_tps, 2) if chat else None,
        "accepted_share_freetext": round(chat[1].accepted / max(1, chat[1].drafted), 3) if chat else None,
        "equal_answers_freetext": equal_answers(chat),
        "spec_over_plain_quote_sampled": ratio(sampled_quote[1], sampled_quote[0]) if sampled_quote else None,
        "spec_over_plain_freetext_sampled": ratio(sampled_chat[1], sampled_chat[0]) if sampled_chat else None,
        "genai_decode_tps_quote": round(genai[0].decode_tps, 2) if genai else None,
        "genai_prompt_lookup_decode_tps_quote": round(genai[1].decode_tps, 2) if genai else None,
        "agentkv_over_genai_prompt_lookup_quote": ratio(quote[1], genai[1]) if quote and genai else None,
        **batched_figures(rounds),
        "mean_tokens_per_call_toolcalls": round(statistics.fmean(len(a) for a in on.answers), 1) if on.answers
        else None,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--exact", action="store_true", help="open_engine(exact=True): f32 numerics")
    parser.add_argument("--workloads", default="toolcalls,quote,freetext,sampled,batched",
                        help="comma-separated subset")
    parser.add_argument("--repeats-batched", type=int, default=3, help="pairs of batched rounds (off, on)")
    parser.add_argument("--genai", action="store_true", help="also LLMPipeline plain and with prompt lookup")
    anyio.run(main, parser.parse_args())
