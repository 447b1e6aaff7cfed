"""Prefill with logits for the last position only (a slice inserted before the LM head) vs all positions.

Prints the median prefill time of each for a few prompt lengths, measured side by side;
the last line is one JSON object ``{"full_over_sliced_prefill": {length: ratio}}``.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from agentkv.engine.stateful.engine import StatefulEngine
from _results import print_result


def prefill_seconds(engine: StatefulEngine, length: int, repeats: int = 5) -> float:
    slot = engine.pool._free[0]  # a raw slot: this measures the forward pass alone
    ids = np.random.default_rng(0).integers(200, 40000, size=(1, length))
    times = []
    for _ in range(repeats):
        slot.reset()
        started = time.perf_counter()
        slot.feed(ids, past_len=0)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    sliced = StatefulEngine(num_slots=1, slice_logits=True)
    full = StatefulEngine(num_slots=1, slice_logits=False)
    ratios = {}
    print(f"{'tokens':>7} {'sliced ms':>10} {'full ms':>10} {'full/sliced':>12}")
    for length in (128, 512, 1024, 2048):
        a, b = prefill_seconds(sliced, length), prefill_seconds(full, length)
        ratios[length] = round(b / a, 3)
        print(f"{length:7d} {a * 1000:10.1f} {b * 1000:10.1f} {b / a:12.2f}")
    print_result(__file__, {"full_over_sliced_prefill": ratios})


if __name__ == "__main__":
    main()
