"""Stateful vs paged form of the default model, side by side in one run (issue 15's first step).

Same numerics (the engine defaults: f16 KV, this CPU's compute), round-robin repeats, medians:
a 1,700-token prefill, a 116-token turn over those 1,700 tokens of KV, greedy decode tok/s of
one sequence, and 8 sequences (200–1,460 tokens of history) decoding 32 tokens together in
one paged step vs one at a time. Last line: JSON ratios.
Run: ``.venv/bin/python benchmarks/paged_step.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.engine.paged.block_pool import BlockPool
from agentkv.kv.log import KVLog
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.paged.model import PagedModel, SequenceStep
from agentkv.engine.paged.block_table import blocks_for
from agentkv.engine.paged.slot import PagedSlot
from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result

IDS = np.random.default_rng(0).integers(200, 40000, 4000).tolist()
HISTORY, TURN, DECODE = 1700, 116, 64
BATCH_HISTORIES = [200, 380, 560, 740, 920, 1100, 1280, 1460]


async def stateful_round(engine: StatefulEngine) -> dict[str, float]:
    session = await engine.open_session()
    try:
        prefill = await session.prefill(IDS[:HISTORY])
        turn = await session.prefill(IDS[: HISTORY + TURN])
        result = await session.generate(IDS[: HISTORY + TURN], GenerationConfig(max_new_tokens=DECODE, ignore_eos=True))
    finally:
        await session.close()
    return {"prefill": prefill.ttft_s, "turn": turn.ttft_s, "decode_tps": 1 / result.metrics.tpot_s}


def paged_round(model: PagedModel) -> dict[str, float]:
    pool = BlockPool(model.num_blocks)
    slot, log = PagedSlot(model, pool), KVLog()
    started = time.perf_counter()
    log.feed(slot, IDS[:HISTORY])
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    logits = log.feed(slot, IDS[HISTORY : HISTORY + TURN])
    turn = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(DECODE):
        logits = log.feed(slot, [int(np.argmax(logits))])
    decode_tps = DECODE / (time.perf_counter() - started)
    slot.reset()
    return {"prefill": prefill, "turn": turn, "decode_tps": decode_tps}


def batch_round(model: PagedModel) -> dict[str, float]:
    """8 sequences decode 32 tokens: in one step each, then one sequence at a time."""
    pool = BlockPool(model.num_blocks)
    tables, lengths, last = [], [], []
    for i, history in enumerate(BATCH_HISTORIES):
        tables.append(pool.allocate(blocks_for(history + 32)))
        ids = IDS[i * 100 : i * 100 + history]
        last.append(int(np.argmax(model.step([SequenceStep(ids, 0, tables[-1])])[0])))
        lengths.append(history)
    started = time.perf_counter()
    for _ in range(32):
        logits = model.step([SequenceStep([t], n, b) for t, n, b in zip(last, lengths, tables)])
        last, lengths = [int(np.argmax(row)) for row in logits], [n + 1 for n in lengths]
    together = 32 * len(tables) / (time.perf_counter() - started)
    lengths = [n - 32 for n in lengths]
    started = time.perf_counter()
    for _ in range(32):
        for i in range(len(tables)):
            row = model.step([SequenceStep([last[i]], lengths[i], tables[i])])[0]
            last[i], lengths[i] = int(np.argmax(row)), lengths[i] + 1
    alone = 32 * len(tables) / (time.perf_counter() - started)
    for table in tables:
        pool.release(table)
    return {"batched_tps": together, "sequential_tps": alone}


async def main(repeats: int) -> None:
    stateful = StatefulEngine(num_slots=1, prefix_cache_bytes=0)
    paged = PagedModel(resolve_model(None), num_blocks=512)
    paged.wait_for_graphs()  # measured on every graph, none compiling beside it
    print(f"numerics: stateful {stateful.numerics}; paged {paged.numerics}")
    await stateful_round(stateful)
    paged_round(paged)  # warm-up both
    rows: dict[str, list[dict[str, float]]] = {"stateful": [], "paged": [], "batch": []}
    for r in range(repeats):
        rows["stateful"].append(await stateful_round(stateful))
        rows["paged"].append(paged_round(paged))
        rows["batch"].append(batch_round(paged))
        print(f"repeat {r + 1}: {rows['stateful'][-1]} | {rows['paged'][-1]} | {rows['batch'][-1]}", flush=True)
    await stateful.aclose()
    med = {k: {m: statistics.median(x[m] for x in v) for m in v[0]} for k, v in rows.items()}
    print(f"\n| | stateful | paged |\n|---|---:|---:|\n| prefill {HISTORY} | {med['stateful']['prefill']:.2f} s | "
          f"{med['paged']['prefill']:.2f} s |\n"
          f"| {TURN}-token turn over {HISTORY} | {med['stateful']['turn'] * 1e3:.0f} ms | "
          f"{med['paged']['turn'] * 1e3:.0f} ms |\n| decode | {med['stateful']['decode_tps']:.1f} tok/s | "
          f"{med['paged']['decode_tps']:.1f} tok/s |\n"
          f"| 8 sequences decoding | — | {med['batch']['batched_tps']:.0f} tok/s "
          f"together, {med['batch']['sequential_tps']:.0f} one at a time |")
    print_result(__file__, {
        "stateful_over_paged_prefill_1700": round(med["stateful"]["prefill"] / med["paged"]["prefill"], 2),
        "stateful_over_paged_turn_ttft": round(med["stateful"]["turn"] / med["paged"]["turn"], 2),
        "paged_over_stateful_decode": round(med["paged"]["decode_tps"] / med["stateful"]["decode_tps"], 2),
        "batched_over_sequential_8": round(med["batch"]["batched_tps"] / med["batch"]["sequential_tps"], 2),
        "medians": med,
    })


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    anyio.run(main, parser.parse_args().repeats)
