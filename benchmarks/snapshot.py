"""KV snapshots: resume a ~2,000-token session in a NEW process from a disk snapshot vs re-prefilling it.

The parent process prefills a ~2,000-token conversation, writes its KV snapshot to disk in
f16 and u8, and starts a child process. The child compiles the engine (not timed: both
paths need it), evicts the files from the OS page cache, then times the first token of the
next turn two ways: restore (read + verify the file, set the KV, prefill the new turn) and
re-prefill (the whole history + the new turn). Also reports bytes per token on disk.
The engine ``open_engine`` picks (``--engine paged|stateful`` chooses; the child process uses
the same backend: snapshots do not cross backends). ``--kv-cache u8`` runs the paged engine on
u8 blocks: its snapshot is then the raw blocks ("u8-paged"), timed as a third form. The last
line is one JSON object.
Run: ``python benchmarks/snapshot.py [--engine stateful] [--kv-cache u8]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.kv.snapshot import KVSnapshot
from agentkv.engine.factory import ENGINE_ENV, open_engine
from agentkv.engine.stateful.engine import StatefulEngine

PARAGRAPHS = [
    "The harbour authority reported that container traffic rose in the spring, mostly from new routes to the north.",
    "Engineers replaced the old cranes with electric ones, which cut noise at night and lowered fuel costs.",
    "Fishermen complained that the new berths took space from the traditional market on the east quay.",
    "The city council proposed a tram line along the waterfront to reduce lorry traffic in the old town.",
    "A museum of maritime history opened in a restored warehouse, with models of every ship built here.",
]
NEXT_TURN = "<|im_start|>user\nSummarise the discussion in two sentences.<|im_end|>\n<|im_start|>assistant\n"


def history(engine: StatefulEngine, target: int) -> list[int]:
    """A chat of about ``target`` tokens, ending after an assistant turn."""
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while True:
        messages.append({"role": "user", "content": " ".join(PARAGRAPHS[(i + k) % 5] for k in range(3))})
        messages.append({"role": "assistant", "content": PARAGRAPHS[i % 5]})
        ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=False))
        if len(ids) >= target:
            return ids
        i += 1


KV_ENV = "AGENTKV_BENCH_KV_CACHE"
"""The KV cache precision both processes use (set by ``--kv-cache``)."""


def engine_options() -> dict[str, str]:
    kv = os.environ.get(KV_ENV)
    return {"kv_cache_precision": kv} if kv else {}


async def parent(target: int, workdir: Path) -> dict[str, float]:
    engine = open_engine(num_slots=1, **engine_options())
    print(f"engine: {type(engine).__name__}")
    ids = history(engine, target)
    session = await engine.open_session()
    await session.prefill(ids)
    snap = await session.snapshot()  # lossless: floats, or a u8 paged cache's raw blocks
    await engine.aclose()
    keys, values = snap.to_float()
    files = {}
    for precision in ("f16", "u8"):
        path = workdir / f"session.{precision}.kvsnap"
        KVSnapshot.from_float(snap.tokens, keys, values, precision=precision,  # type: ignore[arg-type]
                              fingerprint=snap.fingerprint).to_file(path)
        files[precision] = str(path)
    if snap.precision == "u8-paged":  # a u8 paged cache: its raw blocks, as the engine stores them
        path = workdir / "session.u8-paged.kvsnap"
        snap.to_file(path)
        files["u8-paged"] = str(path)
    sizes = {p: os.path.getsize(f) / len(ids) for p, f in files.items()}
    print(f"history {len(ids)} tokens; on disk: " + ", ".join(f"{p} {b:.0f} B/token" for p, b in sizes.items()))
    child = subprocess.run([sys.executable, __file__, "--child", json.dumps(files)],
                           capture_output=True, text=True, check=True)
    timings = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"{'path (new process)':<26} {'TTFT ms':>9} {'first token':>12}")
    for name in ("reprefill", *(f"restore_{p}" for p in files)):
        t = timings[name]
        print(f"{name:<26} {t['ttft'] * 1000:9.1f} {t['token']:12d}   {t.get('detail', '')}")
    out = {
        "reprefill_over_restore": timings["reprefill"]["ttft"] / timings["restore_f16"]["ttft"],
        "reprefill_over_restore_u8": timings["reprefill"]["ttft"] / timings["restore_u8"]["ttft"],
        "bytes_per_token_f16": sizes["f16"],
        "bytes_per_token_u8": sizes["u8"],
    }
    if "u8-paged" in files:
        out["reprefill_over_restore_u8_paged"] = timings["reprefill"]["ttft"] / timings["restore_u8-paged"]["ttft"]
        out["bytes_per_token_u8_paged"] = sizes["u8-paged"]
    return out


def drop_from_page_cache(path: str) -> None:
    """Make the next read come from the disk, not from memory (no root needed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


async def child(files: dict[str, str]) -> dict[str, dict]:
    engine = open_engine(num_slots=1, **engine_options())
    turn = engine.tokenizer.encode(NEXT_TURN)
    one = GenerationConfig(max_new_tokens=1)
    warm = await engine.open_session()  # first inference allocates; keep it out of both timings
    await warm.generate(turn, one)
    await warm.close()
    out: dict[str, dict] = {}
    tokens: tuple[int, ...] = ()
    for precision, path in files.items():
        drop_from_page_cache(path)
        started = time.perf_counter()
        snap = KVSnapshot.from_file(path, expected_fingerprint=engine.fingerprint)
        loaded = time.perf_counter()
        session = await engine.open_session()
        await session.restore(snap)
        result = await session.generate(list(snap.tokens) + turn, one)
        out[f"restore_{precision}"] = {
            "ttft": time.perf_counter() - started, "token": result.token_ids[0],
            "detail": f"load {1000 * (loaded - started):.0f} ms, prefilled {result.metrics.prefilled_tokens}",
        }
        tokens = snap.tokens
        await session.close()
    session = await engine.open_session()
    started = time.perf_counter()
    result = await session.generate(list(tokens) + turn, one)
    out["reprefill"] = {"ttft": time.perf_counter() - started, "token": result.token_ids[0],
                        "detail": f"prefilled {result.metrics.prefilled_tokens}"}
    await engine.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history-tokens", type=int, default=2000)
    parser.add_argument("--engine", choices=["paged", "stateful"], default=None)
    parser.add_argument("--kv-cache", choices=["f16", "u8"], default=None,
                        help="the engine's KV cache precision (u8 on paged: raw-block snapshots)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        os.environ[ENGINE_ENV] = args.engine  # NOTE: the child process inherits it
    if args.kv_cache:
        os.environ[KV_ENV] = args.kv_cache
    if args.child:
        print(json.dumps(anyio.run(child, json.loads(args.child)), default=int))
        return
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-") as workdir:
        result = anyio.run(parent, args.history_tokens, Path(workdir))
    print(json.dumps({k: round(v, 2) for k, v in result.items()}))


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
