"""Multi-turn TTFT: agentkv KV session vs stateless re-prefill vs openvino-genai LLMPipeline + ChatHistory.

A chat of ~100-token user turns and 64-token answers. Per turn it prints TTFT for:
agentkv (one KV session: prefills only the new turn), stateless (same engine, the whole
history re-prefilled every turn) and LLMPipeline.generate(ChatHistory). Then decode speed.
The last line is one JSON object with the ratios. Run: ``python benchmarks/multiturn.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import anyio
import openvino_genai as og
from _turns import SENTENCES, padded_turn

from agentkv.chat.messages import Message
from agentkv.chat.render import ChatRenderer
from agentkv.engine.base import GenerationConfig
from agentkv.engine.stateful import StatefulEngine


def user_turn(engine: StatefulEngine, turn: int, target: int = 100) -> str:
    return padded_turn(engine.tokenizer.encode, f"Turn {turn}.", " Summarise this.",
                       start=turn, sentences=SENTENCES[:7], target=target)


async def measure(turns: int, answer_tokens: int) -> dict:
    engine = StatefulEngine(num_slots=2)
    renderer = ChatRenderer(engine.tokenizer)
    pipe = og.LLMPipeline(str(engine.files.ir_dir), "CPU", ATTENTION_BACKEND="SDPA")
    cfg = GenerationConfig(max_new_tokens=answer_tokens, ignore_eos=True)
    system = Message.system("You are a helpful assistant that summarises text.")
    messages: list[Message] = []
    history = og.ChatHistory()
    history.append({"role": "system", "content": system.content})
    gcfg = og.GenerationConfig()
    gcfg.max_new_tokens = answer_tokens
    gcfg.ignore_eos = True
    kv_session = await engine.open_session()
    stateless = await engine.open_session()
    rows, tpots, genai_tpots = [], [], []
    for turn in range(1, turns + 1):
        text = user_turn(engine, turn)
        messages.append(Message.user(text))
        prompt = renderer.render([system, *messages]).token_ids
        result = await kv_session.generate(prompt, cfg)
        messages.append(Message.assistant(result.text, token_ids=result.token_ids))
        tpots.append(result.metrics.tpot_s)
        await stateless.trim(0)
        cold = await stateless.generate(prompt, GenerationConfig(max_new_tokens=1))
        history.append({"role": "user", "content": text})
        out = pipe.generate(history, gcfg)
        history.append({"role": "assistant", "content": out.texts[0]})
        genai_ttft = out.perf_metrics.get_ttft().mean / 1000
        genai_tpots.append(out.perf_metrics.get_tpot().mean / 1000)
        rows.append(
            {
                "turn": turn,
                "history_tokens": len(prompt),
                "agentkv_ttft": result.metrics.ttft_s,
                "agentkv_prefilled": result.metrics.prefilled_tokens,
                "stateless_ttft": cold.metrics.ttft_s,
                "genai_chat_ttft": genai_ttft,
            }
        )
        r = rows[-1]
        print(
            f"turn {turn:2d}  history {len(prompt):5d} tok  agentkv {r['agentkv_ttft'] * 1000:7.1f} ms "
            f"(prefilled {r['agentkv_prefilled']:4d})  stateless {r['stateless_ttft'] * 1000:7.1f} ms  "
            f"genai-chat {genai_ttft * 1000:7.1f} ms",
            flush=True,
        )
    await engine.aclose()
    return {"rows": rows, "tpot": statistics.median(tpots), "genai_tpot": statistics.median(genai_tpots)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=13)
    parser.add_argument("--answer-tokens", type=int, default=64)
    args = parser.parse_args()
    data = anyio.run(measure, args.turns, args.answer_tokens)
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
    }
    print(f"2K point: turn {at2k['turn']} with {at2k['history_tokens']} tokens of history")
    print(f"decode: agentkv {1 / data['tpot']:.1f} tok/s, LLMPipeline {1 / data['genai_tpot']:.1f} tok/s")
    print(json.dumps({k: round(v, 3) for k, v in ratio.items()}))


if __name__ == "__main__":
    main()
