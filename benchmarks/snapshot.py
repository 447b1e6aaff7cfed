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

``--file-format`` needs no model: it times writing and reading (warm, and cold from the disk) a
~1,500-token snapshot of the default model's shape in the safetensors files agentkv writes and in
the older raw layout it still reads (written by ``tests/_legacy_snapshot.py``), side by side, per
precision; each read verifies the checksum and each write computes it, as in use.
Run: ``python benchmarks/snapshot.py --file-format [--history-tokens 1500]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.engine.factory import ENGINE_ENV, open_engine
from agentkv.engine.stateful.engine import StatefulEngine
from agentkv.kv.snapshot import KVSnapshot
from _results import print_result

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


def file_formats(num_tokens: int, repeats: int, workdir: Path) -> dict[str, float]:
    """Median ms to write / read a snapshot file, safetensors ("new") vs the older raw layout ("old")."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from _legacy_snapshot import write_legacy

    rng = np.random.default_rng(0)
    shape = (30, 1, 3, num_tokens, 64)  # layers, batch, heads, T, head_dim of the default model
    keys, values = rng.standard_normal(shape, dtype=np.float32), rng.standard_normal(shape, dtype=np.float32)
    writers: dict[str, Callable[[KVSnapshot, Path], None]] = {"old": write_legacy, "new": KVSnapshot.to_file}
    out: dict[str, float] = {}
    print(f"{num_tokens} tokens, median of {repeats} (ms)")
    print(f"{'precision':<10} {'MB':>6} {'write old':>10} {'write new':>10} {'read old':>9} {'read new':>9}"
          f" {'cold old':>9} {'cold new':>9}")
    for precision in ("f32", "bf16", "f16", "u8"):
        made = KVSnapshot.from_float(range(num_tokens), keys, values, precision=precision,  # type: ignore[arg-type]
                                     fingerprint="bench")
        times: dict[str, list[float]] = {}
        for repeat in range(repeats):
            order = list(writers.items()) if repeat % 2 == 0 else list(writers.items())[::-1]
            for form, write in order:  # interleaved, each first half the time: both see the same machine
                path = workdir / f"{form}.{precision}.agkv"
                fresh = KVSnapshot.from_float(made.tokens, keys, values, precision=precision,  # type: ignore[arg-type]
                                              fingerprint="bench")  # an uncomputed checksum, as in use
                started = time.perf_counter()
                write(fresh, path)
                times.setdefault(f"write_{form}", []).append(time.perf_counter() - started)
                for temperature in ("warm", "cold"):
                    if temperature == "cold":
                        drop_from_page_cache(str(path))
                    started = time.perf_counter()
                    back = KVSnapshot.from_file(path, expected_fingerprint="bench")
                    times.setdefault(f"{temperature}_{form}", []).append(time.perf_counter() - started)
                    assert back.checksum() == made.checksum()
        ms = {name: 1000 * statistics.median(values) for name, values in times.items()}
        print(f"{precision:<10} {made.nbytes / 1e6:6.1f} {ms['write_old']:10.1f} {ms['write_new']:10.1f} "
              f"{ms['warm_old']:9.1f} {ms['warm_new']:9.1f} {ms['cold_old']:9.1f} {ms['cold_new']:9.1f}")
        out.update({f"{precision}_{name}_ms": value for name, value in ms.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history-tokens", type=int, default=2000)
    parser.add_argument("--engine", choices=["paged", "stateful"], default=None)
    parser.add_argument("--kv-cache", choices=["f16", "u8"], default=None,
                        help="the engine's KV cache precision (u8 on paged: raw-block snapshots)")
    parser.add_argument("--file-format", action="store_true",
                        help="time snapshot files only (no model): safetensors vs the older raw layout")
    parser.add_argument("--repeats", type=int, default=7, help="--file-format: runs per measurement")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.file_format:
        with tempfile.TemporaryDirectory(prefix="agentkv-bench-") as workdir:
            tokens = 1500 if args.history_tokens == 2000 else args.history_tokens
            result = file_formats(tokens, args.repeats, Path(workdir))
        print_result(__file__, {k: round(v, 1) for k, v in result.items()}, variant="file_format")
        return
    if args.engine:
        os.environ[ENGINE_ENV] = args.engine  # NOTE: the child process inherits it
    if args.kv_cache:
        os.environ[KV_ENV] = args.kv_cache
    if args.child:
        print(json.dumps(anyio.run(child, json.loads(args.child)), default=int))
        return
    with tempfile.TemporaryDirectory(prefix="agentkv-bench-") as workdir:
        result = anyio.run(parent, args.history_tokens, Path(workdir))
    print_result(__file__, {k: round(v, 2) for k, v in result.items()})


if __name__ == "__main__":
    np.seterr(all="ignore")
    main()
