"""CPU-plugin numerics vs speed: dynamic quantization, inference precision and KV cache precision.

One ``StatefulEngine`` per configuration (default/f16 — the engine's default —, default/u8,
dq_off/f16, f32_infer/f16, exact/f32), measured round-robin so machine noise hits all alike:
TTFT of a one-pass prefill of 1,000 tokens, a 116-token delta prefilled over those 1,000 tokens
of KV, and decode tok/s (64 tokens after the 1K prefill). Prints what each compiled model
reports, a markdown table of medians, and as the last line one JSON object of ratios over
default/f16 (">1": slower prefill, faster decode) plus the raw medians.
Run: ``.venv/bin/python benchmarks/numerics.py [--repeats 3] [--configs default/u8,exact/f32]``.
"""

from __future__ import annotations

import argparse
import statistics

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result

DQ_OFF = {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
F32_INFER = {"INFERENCE_PRECISION_HINT": "f32"}
CONFIGS: dict[str, tuple[str, dict[str, str]]] = {  # name -> (kv precision, ov_config)
    "default/f16": ("f16", {}),
    "default/u8": ("u8", {}),
    "dq_off/f16": ("f16", DQ_OFF),
    "f32_infer/f16": ("f16", F32_INFER),
    "exact/f32": ("f32", {**DQ_OFF, **F32_INFER}),
}
BASE, DELTA, DECODE = 1000, 116, 64


async def one_round(engine: StatefulEngine, ids: list[int]) -> dict[str, float]:
    """Fresh session: prefill 1K, then the 1,116-token prompt (116 new), then decode after 1K."""
    session = await engine.open_session()
    try:
        base = await session.prefill(ids[:BASE])
        delta = await session.prefill(ids)
        assert base.prefilled_tokens == BASE and delta.prefilled_tokens == DELTA, (base, delta)
        await session.trim(BASE)  # back to the 1K prefix: the decode runs after exactly 1K of KV
        result = await session.generate(ids[:BASE], GenerationConfig(max_new_tokens=DECODE, ignore_eos=True))
        assert result.metrics.generated_tokens == DECODE
    finally:
        await session.close()
    return {"prefill_1k": base.ttft_s, "delta": delta.ttft_s, "decode_tps": 1 / result.metrics.tpot_s}


async def measure(names: list[str], repeats: int) -> tuple[dict, dict]:
    ids = np.random.default_rng(0).integers(200, 40000, size=BASE + DELTA).tolist()
    engines, props = {}, {}
    for name in names:
        kv, ov_config = CONFIGS[name]
        engines[name] = StatefulEngine(num_slots=1, prefix_cache_bytes=0, kv_cache_precision=kv, ov_config=ov_config)
        props[name] = engines[name].numerics
        print(f"{name:14s} compiled: {props[name]}", flush=True)
        await one_round(engines[name], ids)  # warm-up: first-shape kernel compilation, page faults
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    for r in range(repeats):
        for name in names:  # round-robin: each repeat visits every configuration once
            s = await one_round(engines[name], ids)
            samples[name].append(s)
            print(f"repeat {r + 1}  {name:14s} prefill 1K {s['prefill_1k']:.3f} s  "
                  f"delta {s['delta'] * 1000:6.1f} ms  decode {s['decode_tps']:6.1f} tok/s", flush=True)
    for engine in engines.values():
        await engine.aclose()
    medians = {name: {k: statistics.median(s[k] for s in rows) for k in rows[0]} for name, rows in samples.items()}
    return medians, props


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated subset of: " + ", ".join(CONFIGS))
    args = parser.parse_args()
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown or not names:
        parser.error(f"unknown configs {unknown}; choose from {list(CONFIGS)}")
    medians, props = anyio.run(measure, names, args.repeats)

    print(f"\nmedians of {args.repeats} repeat(s); {BASE}-token prefill, {DELTA}-token delta, {DECODE}-token decode\n")
    print("| config | kv | dq group | compute | prefill 1K s | delta 116 ms | decode tok/s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for name, m in medians.items():
        config = name.partition("/")[0]
        p = props[name]
        print(f"| {config} | {p.kv_cache} | {p.dynamic_quantization_group_size} | {p.inference} | "
              f"{m['prefill_1k']:.3f} | {m['delta'] * 1000:.1f} | {m['decode_tps']:.1f} |")

    out: dict[str, object] = {}
    ref = medians.get("default/f16")
    labels = {"default/u8": "u8_over_f16", "dq_off/f16": "dq_off_over_default",
              "f32_infer/f16": "f32_compute_over_default", "exact/f32": "exact_over_default"}
    if ref is not None:
        for name, label in labels.items():
            if name in medians:
                for key in ("prefill_1k", "delta", "decode_tps"):
                    out[f"{label}_{key}"] = round(medians[name][key] / ref[key], 3)
    out["medians"] = {name: {"prefill_1k_s": round(m["prefill_1k"], 4), "delta_ms": round(m["delta"] * 1000, 2),
                             "decode_tps": round(m["decode_tps"], 2)} for name, m in medians.items()}
    print_result(__file__, out)


if __name__ == "__main__":
    main()
