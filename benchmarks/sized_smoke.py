"""A realistic-size model on agentkv's default engine and on LLMPipeline, one prompt each, side by side.

Issue 47's first check on the 1.5B-class model (``--model qwen2.5-1.5b-shape``, built on demand; or
any IR path): opens agentkv's default engine (``open_engine``: paged, its default KV precision),
waits for its graphs, then on a fresh session one ~2K-token chat prompt (``--prompt-tokens``) and a
64-token greedy answer (EOS ignored): TTFT and decode tok/s (tokens after the first over the time
after the first), and the KV bytes per token its blocks keep. Then ``openvino_genai.LLMPipeline``
(default backend and properties: PagedAttention with prefix caching) on the same directory, the
same prompt ids, the same answer length: the same two numbers, and the KV precision the CPU plugin
gives it by default (``KV_CACHE_PRECISION``, with the compute precision; an avx2 CPU: u8 KV, f32
compute). ``--u8`` adds agentkv's paged engine with u8 blocks (the plugin's layout: the bytes per
token LLMPipeline's default keeps). Each is warmed up on a short prompt first. One run: on a shared
machine the figures drift; say so beside them. The last line is one JSON object.
Run: ``python benchmarks/sized_smoke.py [--model qwen2.5-1.5b-shape] [--prompt-tokens 2048] [--u8]``.

Measured (2026-11-28, AMD EPYC avx2 without avx512, 2 cores shared with other engineers' test runs,
load average 3-7; two runs, a 2,069-token prompt, 64 tokens): agentkv f16 blocks 28,672 B/token, TTFT
142 s / 104 s, decode 4.0 / 6.1 tok/s; LLMPipeline (the plugin's defaults here: u8 KV, f32 compute)
179 s / 107 s, 2.3 / 3.1 tok/s; agentkv with u8 blocks (first run) 16,576 B/token (58 % of f16:
by-channel u8 keys with their scales, per-token u8 values), 118 s, 5.1 tok/s. Prefill runs at ~15-20
tokens/s on this CPU: a cold 16K prompt would take 15-20 min here.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import openvino as ov
import openvino_genai as og
from _sized_models import model_arg
from _turns import padded_turn

from agentkv.chat.messages import Message
from agentkv.chat.render import ChatRenderer
from agentkv.engine.base import GenerationConfig
from agentkv.engine.factory import open_engine
from _results import print_result

SYSTEM = "You are a helpful assistant that summarises text."


def prompts(engine: Any, prompt_tokens: int) -> tuple[list[int], list[int]]:
    """(warm-up prompt ids, measured prompt ids): chat-rendered, the measured one ~``prompt_tokens`` long."""
    renderer = ChatRenderer(engine.tokenizer)
    warm = renderer.render([Message.user("Warm up: say anything.")]).token_ids
    text = padded_turn(engine.tokenizer.encode, "Read this.", " Summarise it.", start=0, target=prompt_tokens - 40)
    measured = renderer.render([Message.system(SYSTEM), Message.user(text)]).token_ids
    return list(warm), list(measured)


async def agentkv_figures(model: str, prompt_tokens: int, answer: int, **options: Any) -> dict[str, Any]:
    """Open the engine (``options`` as open_engine takes), wait for its graphs, warm up, then the prompt."""
    started = time.perf_counter()
    engine = open_engine(model, **options)
    opened = time.perf_counter() - started
    try:
        paged = getattr(engine, "paged_model", None)
        graphs = paged.wait_for_graphs() if paged is not None else 0
        warm, measured = prompts(engine, prompt_tokens)
        config = GenerationConfig(max_new_tokens=answer, ignore_eos=True)
        warm_session = await engine.open_session()
        first = await warm_session.generate(warm, GenerationConfig(max_new_tokens=8, ignore_eos=True))
        session = await engine.open_session()
        result = await session.generate(measured, config)
        metrics = result.metrics
        return {"engine": type(engine).__name__, "open_s": opened, "graphs": graphs,
                "kv_precision": getattr(paged, "kv_cache_precision", "?"),
                "kv_bytes_per_token": engine.kv_bytes_per_token(), "prompt_ids": measured, "warm_ids": warm,
                "warm_text": first.text, "prompt_tokens": len(measured), "prefilled": metrics.prefilled_tokens,
                "ttft_s": metrics.ttft_s, "decode_tps": 1 / metrics.tpot_s, "generated": metrics.generated_tokens}
    finally:
        await engine.aclose()


def genai_figures(ir_dir: str, warm_ids: list[int], prompt_ids: list[int], answer: int) -> dict[str, Any]:
    """LLMPipeline with its defaults on ``ir_dir``: warm up, then ``prompt_ids`` (as token ids)."""
    started = time.perf_counter()
    pipe = og.LLMPipeline(ir_dir, "CPU")
    opened = time.perf_counter() - started
    config = og.GenerationConfig()
    config.max_new_tokens, config.ignore_eos = 8, True
    pipe.generate(_tokenized(warm_ids), config)
    config.max_new_tokens = answer
    out = pipe.generate(_tokenized(prompt_ids), config)
    metrics = out.perf_metrics
    del pipe
    gc.collect()
    return {"open_s": opened, "ttft_s": metrics.get_ttft().mean / 1000,
            "decode_tps": 1000 / metrics.get_tpot().mean, "generated": metrics.get_num_generated_tokens()}


def _tokenized(ids: list[int]) -> og.TokenizedInputs:
    """``ids`` as LLMPipeline's input (one sequence, all attended): the same tokens agentkv was fed."""
    return og.TokenizedInputs(ov.Tensor(np.array([ids], dtype=np.int64)),
                              ov.Tensor(np.ones((1, len(ids)), dtype=np.int64)))


def plugin_defaults() -> dict[str, str]:
    """The CPU plugin's default KV and compute precisions (what LLMPipeline gets when given none)."""
    core = ov.Core()
    names = ("KV_CACHE_PRECISION", "KEY_CACHE_PRECISION", "VALUE_CACHE_PRECISION", "KEY_CACHE_GROUP_SIZE",
             "VALUE_CACHE_GROUP_SIZE", "INFERENCE_PRECISION_HINT")
    values = {name: core.get_property("CPU", name) for name in names}
    return {name: value.get_type_name() if isinstance(value, ov.Type) else str(value) for name, value in values.items()}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen2.5-1.5b-shape", help="a realistic-size model's name or an IR path")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--u8", action="store_true", help="also agentkv's paged engine with u8 KV blocks")
    args = parser.parse_args()
    model = model_arg(args.model)
    assert model is not None
    out: dict[str, Any] = {"model": args.model, "cpu": _cpu_flags(), "genai_defaults": plugin_defaults()}
    agentkv = anyio.run(lambda: agentkv_figures(model, args.prompt_tokens, args.answer_tokens))
    prompt_ids, warm_ids = agentkv.pop("prompt_ids"), agentkv.pop("warm_ids")
    out["agentkv"] = agentkv
    print(f"agentkv ({agentkv['kv_precision']} KV, {agentkv['kv_bytes_per_token']} B/token): "
          f"TTFT {agentkv['ttft_s'] * 1000:.0f} ms for {agentkv['prompt_tokens']} tokens, "
          f"decode {agentkv['decode_tps']:.1f} tok/s; opened in {agentkv['open_s']:.1f} s", flush=True)
    if args.u8:
        u8 = anyio.run(lambda: agentkv_figures(model, args.prompt_tokens, args.answer_tokens,
                                               kv_cache_precision="u8"))
        u8.pop("prompt_ids"), u8.pop("warm_ids")
        out["agentkv_u8"] = u8
        print(f"agentkv u8 ({u8['kv_bytes_per_token']} B/token): TTFT {u8['ttft_s'] * 1000:.0f} ms, "
              f"decode {u8['decode_tps']:.1f} tok/s", flush=True)
    genai = genai_figures(str(Path(model)), warm_ids, prompt_ids, args.answer_tokens)
    out["genai"] = genai
    print(f"LLMPipeline (default; plugin KV {out['genai_defaults']['KV_CACHE_PRECISION']}, compute "
          f"{out['genai_defaults']['INFERENCE_PRECISION_HINT']}): TTFT {genai['ttft_s'] * 1000:.0f} ms, "
          f"decode {genai['decode_tps']:.1f} tok/s; opened in {genai['open_s']:.1f} s", flush=True)
    out["ttft_over_genai"] = agentkv["ttft_s"] / genai["ttft_s"]
    out["decode_over_genai"] = agentkv["decode_tps"] / genai["decode_tps"]
    out["peak_rss_gib"] = peak_rss_gib()
    print_result(__file__, _rounded(out))


def _cpu_flags() -> str:
    text = Path("/proc/cpuinfo").read_text(encoding="utf-8") if Path("/proc/cpuinfo").is_file() else ""
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return " ".join(sorted(f for f in flags if f.startswith(("avx", "amx"))))


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


if __name__ == "__main__":
    main()
