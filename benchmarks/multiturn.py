"""Multi-turn TTFT: agentkv (stateful and paged engines) vs stateless re-prefill vs openvino-genai.

A chat of ~100-token user turns and 64-token answers. Per turn it prints TTFT for: agentkv on
the stateful engine and on the paged engine (one KV session each: prefills only the new turn;
the paged engine twice: decoding plainly, and with its default prompt-lookup drafts),
stateless (the stateful engine re-prefilling the whole history every turn), and LLMPipeline +
ChatHistory twice — its SDPA backend and its default (PagedAttention + prefix caching). Then
decode speed: ``paged_over_genai_default_decode`` compares plain decoding (one model step per
token, drafts off), ``paged_drafts_over_genai_default_decode`` the paged engine's defaults. The
last line is one JSON object with the ratios.
Run: ``python benchmarks/multiturn.py [--turns 13] [--paged-prefill-chunk 0]``.
"""

from __future__ import annotations

import argparse
import statistics

import anyio
import openvino_genai as og
from _turns import SENTENCES, padded_turn

from agentkv.chat.messages import Message
from agentkv.chat.render import ChatRenderer
from agentkv.engine.base import GenerationConfig, KVSession
from agentkv.engine.paged.engine import PagedEngine
from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result


def user_turn(engine: StatefulEngine, turn: int, target: int = 100) -> str:
    return padded_turn(engine.tokenizer.encode, f"Turn {turn}.", " Summarise this.",
                       start=turn, sentences=SENTENCES[:7], target=target)


class GenaiChat:
    """One LLMPipeline with its own ChatHistory (the same user turns; its own answers)."""

    def __init__(self, ir_dir: str, system: str, answer_tokens: int, **options: str) -> None:
        self.pipe = og.LLMPipeline(ir_dir, "CPU", **options)
        self.history = og.ChatHistory()
        self.history.append({"role": "system", "content": system})
        self.config = og.GenerationConfig()
        self.config.max_new_tokens, self.config.ignore_eos = answer_tokens, True
        self.tpots: list[float] = []

    def turn(self, text: str) -> float:
        self.history.append({"role": "user", "content": text})
        out = self.pipe.generate(self.history, self.config)
        self.history.append({"role": "assistant", "content": out.texts[0]})
        self.tpots.append(out.perf_metrics.get_tpot().mean / 1000)
        return out.perf_metrics.get_ttft().mean / 1000


class AgentkvChat:
    """One engine's KV session over the rendered chat (its own answers, kept as generated ids)."""

    def __init__(self, engine: StatefulEngine, system: Message, answer_tokens: int, *, drafts: bool = False) -> None:
        self.engine, self.system = engine, system
        self.renderer = ChatRenderer(engine.tokenizer)
        self.messages: list[Message] = []
        self.config = GenerationConfig(max_new_tokens=answer_tokens, ignore_eos=True, prompt_lookup=drafts)
        self.tpots: list[float] = []
        self.session: KVSession | None = None

    async def turn(self, text: str) -> tuple[float, int, list[int]]:
        if self.session is None:
            self.session = await self.engine.open_session()
        self.messages.append(Message.user(text))
        prompt = self.renderer.render([self.system, *self.messages]).token_ids
        result = await self.session.generate(prompt, self.config)
        self.messages.append(Message.assistant(result.text, token_ids=result.token_ids))
        self.tpots.append(result.metrics.tpot_s)
        return result.metrics.ttft_s, result.metrics.prefilled_tokens, list(prompt)


async def measure(turns: int, answer_tokens: int, paged_options: dict) -> dict:
    stateful, paged = StatefulEngine(num_slots=2), PagedEngine(num_slots=2, **paged_options)
    paged.paged_model.wait_for_graphs()  # measured on every graph, none compiling beside it
    system = Message.system("You are a helpful assistant that summarises text.")
    chats = {"agentkv": AgentkvChat(stateful, system, answer_tokens),
             "paged": AgentkvChat(paged, system, answer_tokens),
             "paged_drafts": AgentkvChat(paged, system, answer_tokens, drafts=True)}
    ir_dir = str(stateful.files.ir_dir)
    sdpa = GenaiChat(ir_dir, system.content, answer_tokens, ATTENTION_BACKEND="SDPA")
    default = GenaiChat(ir_dir, system.content, answer_tokens)
    stateless = await stateful.open_session()
    rows = []
    for turn in range(1, turns + 1):
        text = user_turn(stateful, turn)
        ttft, prefilled, prompt = await chats["agentkv"].turn(text)
        paged_ttft, _, _ = await chats["paged"].turn(text)
        await chats["paged_drafts"].turn(text)
        await stateless.trim(0)
        cold = await stateless.generate(prompt, GenerationConfig(max_new_tokens=1))
        rows.append({"turn": turn, "history_tokens": len(prompt), "agentkv_ttft": ttft, "agentkv_prefilled": prefilled,
                     "paged_ttft": paged_ttft, "stateless_ttft": cold.metrics.ttft_s,
                     "genai_chat_ttft": sdpa.turn(text), "genai_default_ttft": default.turn(text)})
        r = rows[-1]
        print(f"turn {turn:2d}  history {len(prompt):5d} tok  "
              f"stateful {ttft * 1000:7.1f} ms (prefilled {prefilled:4d})  "
              f"paged {paged_ttft * 1000:7.1f} ms  stateless {r['stateless_ttft'] * 1000:7.1f} ms  "
              f"genai-sdpa {r['genai_chat_ttft'] * 1000:7.1f} ms  "
              f"genai-default {r['genai_default_ttft'] * 1000:7.1f} ms",
              flush=True)
    await stateful.aclose()
    await paged.aclose()
    return {"rows": rows, "tpot": statistics.median(chats["agentkv"].tpots),
            "paged_tpot": statistics.median(chats["paged"].tpots),
            "paged_drafts_tpot": statistics.median(chats["paged_drafts"].tpots),
            "genai_tpot": statistics.median(sdpa.tpots),
            "genai_default_tpot": statistics.median(default.tpots)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=13)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--paged-prefill-chunk", type=int, default=None,
                        help="the paged engine's prefill_chunk_size (default: its own, 512); 0: whole prompts")
    args = parser.parse_args()
    paged_options = {} if args.paged_prefill_chunk is None else {"prefill_chunk_size": args.paged_prefill_chunk or None}
    data = anyio.run(measure, args.turns, args.answer_tokens, paged_options)
    rows = data["rows"]
    turn10 = rows[min(9, len(rows) - 1)]
    at2k = next((r for r in rows if r["history_tokens"] >= 2000), rows[-1])
    later = rows[1:]  # turn 1 is a cold prefill for everyone
    ratio = {
        "stateless_over_agentkv_turn10": turn10["stateless_ttft"] / turn10["agentkv_ttft"],
        "stateless_over_agentkv_2k": at2k["stateless_ttft"] / at2k["agentkv_ttft"],
        "agentkv_over_genai_chat_ttft": statistics.median(r["agentkv_ttft"] for r in later)
        / statistics.median(r["genai_chat_ttft"] for r in later),
        "agentkv_over_genai_decode": data["genai_tpot"] / data["tpot"],
        "paged_over_genai_default_ttft": statistics.median(r["paged_ttft"] for r in later)
        / statistics.median(r["genai_default_ttft"] for r in later),
        "stateful_over_paged_ttft_2k": at2k["agentkv_ttft"] / at2k["paged_ttft"],
        "paged_over_genai_default_decode": data["genai_default_tpot"] / data["paged_tpot"],
        "paged_drafts_over_genai_default_decode": data["genai_default_tpot"] / data["paged_drafts_tpot"],
    }
    print(f"2K point: turn {at2k['turn']} with {at2k['history_tokens']} tokens of history")
    print(f"decode: agentkv stateful {1 / data['tpot']:.1f}, paged {1 / data['paged_tpot']:.1f} "
          f"(with drafts {1 / data['paged_drafts_tpot']:.1f}), LLMPipeline SDPA "
          f"{1 / data['genai_tpot']:.1f}, default {1 / data['genai_default_tpot']:.1f} tok/s")
    print_result(__file__, {k: round(v, 3) for k, v in ratio.items()}, rows=rows,
                 tpot_s={k: v for k, v in data.items() if k != "rows"})


if __name__ == "__main__":
    main()
