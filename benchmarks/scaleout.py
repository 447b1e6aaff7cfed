"""Scale-out: per-turn TTFT of a conversation with a ~2K-token history that (a) stays on its replica
behind the proxy, (b) moves to another replica, which restores its KV from the S3 snapshot, (c)
moves and re-prefills (its snapshots deleted first); (a) against a lone ``agentkv serve`` on SQLite
and snapshot files, turn by turn in the same run; and the aggregate decode tokens/s of N concurrent
answers on one replica (batched) vs one per replica.

Three replicas of ``agentkv serve`` share PostgreSQL and an S3 bucket behind HAProxy
(``agentkv.testing.cluster.LocalCluster``, ``deploy/haproxy.cfg``). TTFT is measured the same way
everywhere: from sending the turn (``/v1/responses``, streamed, chained by ``previous_response_id``)
to its first text delta. The machine's cores bound the decode figure: N replicas on 2 cores share
them, while one replica batches N answers in one step; the point is that nothing serialises
across replicas. The last line is one JSON object:
``{"moved_reprefill_over_moved_restore": …, "stay_over_single_server_ttft": …, "replicas_3_over_1_decode": …}``
(targets: ≥ 5 at ~2K history; ≤ 1.1).

Run: ``python benchmarks/scaleout.py [--history 2000] [--turns 4] [--moves 3]``. PostgreSQL and the
S3 server come from ``AGENTKV_TEST_POSTGRES_URL`` / ``AGENTKV_TEST_S3_URL`` (and ``AWS_*``), else
this starts them with ``scripts/start_postgres.sh`` and ``scripts/start_s3.sh``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import anyio
import httpx
from _turns import SENTENCES, padded_turn

from agentkv.memory import Store
from agentkv.testing.cluster import LocalCluster
from _results import print_result

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant that summarises text."
TURN_TOKENS = 8
"""Answer length of a measured turn (TTFT is what is measured)."""
DECODE_TOKENS = 96


@dataclass
class Turn:
    """One streamed response: its TTFT, the headers and the final body."""

    ttft_s: float
    seconds: float
    served_by: str
    session_id: str
    body: dict


def respond(url: str, key: str, text: str, previous: str | None, max_tokens: int = TURN_TOKENS) -> Turn:
    """One streamed ``/v1/responses`` turn to ``url`` (the proxy or a replica)."""
    body = {"model": "any", "input": text, "instructions": SYSTEM, "temperature": 0, "stream": True,
            "max_output_tokens": max_tokens, **({"previous_response_id": previous} if previous else {})}
    started, first, final = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/responses", json=body, timeout=600,
                      headers={"Authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url} answered {response.status_code}: {response.read().decode()[:300]}")
        served_by = response.headers.get("X-Served-By", url)
        session_id = response.headers["X-Session-Id"]
        for line in response.iter_lines():
            if not line.startswith("data:"):
                continue
            event = json.loads(line[5:])
            if first is None and event["type"] == "response.output_text.delta" and event["delta"]:
                first = time.perf_counter() - started
            if event["type"] in ("response.completed", "response.incomplete"):
                final = event["response"]
            if event["type"] in ("response.failed", "error"):
                raise RuntimeError(f"{url}: {event}")
    seconds = time.perf_counter() - started
    assert final is not None, "the stream ended without its response"
    return Turn(first if first is not None else seconds, seconds, served_by, session_id, final)


def services() -> tuple[str, str]:
    """The PostgreSQL URL and the S3 snapshot URL (started here when the environment has none)."""
    db = os.environ.get("AGENTKV_TEST_POSTGRES_URL")
    if db is None:
        db = subprocess.run(["bash", "scripts/start_postgres.sh"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout.strip()
    snapshots = os.environ.get("AGENTKV_TEST_S3_URL")
    if snapshots is None:
        exports = subprocess.run(["bash", "scripts/start_s3.sh"], cwd=REPO, check=True, capture_output=True,
                                 text=True).stdout
        for line in exports.splitlines():
            name, _, value = line.removeprefix("export ").partition("=")
            os.environ[name] = shlex.split(value)[0]
        snapshots = os.environ["AGENTKV_TEST_S3_URL"]
    return db, snapshots.rstrip("/") + f"/scaleout-{int(time.time())}"


def remove_objects(snapshots: str) -> int:
    """Delete every object under the run's own S3 prefix (a benchmark run writes ~50 MB per turn)."""
    import boto3

    bucket, _, prefix = snapshots.removeprefix("s3://").partition("/")
    client, removed = boto3.client("s3"), 0
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
        keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
        if keys:
            client.delete_objects(Bucket=bucket, Delete={"Objects": keys})
            removed += len(keys)
    return removed


def drop_snapshots(db: str, snapshots: str, session_id: str) -> int:
    """Delete every snapshot of ``session_id`` (row and object): what (c) moves without."""
    async def drop() -> int:
        async with Store(db, snapshots=snapshots) as store:
            records = await store.snapshots(session_id)
            for record in records:
                await store.delete_snapshot(record)
            return len(records)
    return anyio.run(drop)


def history_and_turns(history_tokens: int, turns: int) -> tuple[str, list[str]]:
    from agentkv.engine.openvino.models import resolve_model
    from agentkv.engine.openvino.tokenizer import OVTokenizer

    encode = OVTokenizer(resolve_model(None).ir_dir).encode
    opening = padded_turn(encode, "Read this report.", " Summarise it in one line.", start=0,
                          sentences=SENTENCES * (history_tokens // 100 + 1), target=history_tokens)
    follow = [padded_turn(encode, f"Question {t}.", " Answer briefly.", start=t, sentences=SENTENCES[:5], target=40)
              for t in range(turns)]
    return opening, follow


def stay_vs_single(cluster: LocalCluster, single: LocalCluster, opening: str, follow: list[str]
                   ) -> dict[str, list[float]]:
    """(a) turns that stay on their replica behind the proxy, and the same turns on a lone server,
    interleaved turn by turn."""
    paths = {"stay": (cluster.proxy_url, cluster.api_key), "single": (single.replica_url(0), single.api_key)}
    previous = {name: respond(url, key, opening, None).body["id"] for name, (url, key) in paths.items()}
    ttfts: dict[str, list[float]] = {name: [] for name in paths}
    whole: dict[str, list[float]] = {name: [] for name in paths}
    for text in follow:
        for name, (url, key) in paths.items():
            turn = respond(url, key, text, previous[name])
            previous[name] = turn.body["id"]
            ttfts[name].append(turn.ttft_s)
            whole[name].append(turn.seconds)
    print("whole turn (TTFT, 8 tokens, the turn-end snapshot: S3 vs a file), median: "
          + ", ".join(f"{name} {1000 * statistics.median(v):.0f} ms" for name, v in whole.items()))
    return ttfts


def moved(cluster: LocalCluster, db: str, snapshots: str, opening: str, question: str,
          moves: int) -> dict[str, list[float]]:
    """(b) and (c): a conversation built on replica 0, whose next turn goes to replica 1 (b: it
    restores the S3 snapshot) or replica 2 (c: its snapshots deleted first, it re-prefills)."""
    url, key = cluster.replica_url, cluster.api_key
    ttfts: dict[str, list[float]] = {"moved_restore": [], "moved_reprefill": []}
    cached: dict[str, list[int]] = {"moved_restore": [], "moved_reprefill": []}
    for _ in range(moves):
        for name, target in (("moved_restore", 1), ("moved_reprefill", 2)):
            first = respond(url(0), key, opening, None)
            if name == "moved_reprefill":
                drop_snapshots(db, snapshots, first.session_id)
            turn = respond(url(target), key, question, first.body["id"])
            ttfts[name].append(turn.ttft_s)
            cached[name].append(turn.body["usage"]["input_tokens_details"]["cached_tokens"])
    print(f"cached tokens after the move: restore {cached['moved_restore']}, re-prefill {cached['moved_reprefill']}")
    if min(cached["moved_restore"]) < len(opening) // 8:
        raise RuntimeError(f"the moved conversations restored {cached['moved_restore']} tokens from S3: the "
                           "snapshots were not written (is the S3 server full? see its log)")
    return ttfts


def decode_rate(targets: list[str], key: str, prompt: str) -> float:
    """Aggregate decode tokens/s of one answer per entry of ``targets``, all sent at once."""
    turns: list[Turn] = []

    def one(url: str) -> None:
        turns.append(respond(url, key, prompt, None, max_tokens=DECODE_TOKENS))

    threads = [threading.Thread(target=one, args=(url,)) for url in targets]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    return sum(t.body["usage"]["output_tokens"] for t in turns) / wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--history", type=int, default=2000, help="tokens of the conversation's first turn")
    parser.add_argument("--turns", type=int, default=4, help="measured turns of (a)")
    parser.add_argument("--moves", type=int, default=3, help="moves measured for (b) and (c) each")
    args = parser.parse_args()
    db, snapshots = services()
    opening, follow = history_and_turns(args.history, args.turns)
    try:
        result = measure(args, db, snapshots, opening, follow)
    finally:
        print(f"removed {remove_objects(snapshots)} snapshot objects under {snapshots}")
    print_result(__file__, {k: round(v, 3) for k, v in result.items()})


def measure(args: argparse.Namespace, db: str, snapshots: str, opening: str, follow: list[str]) -> dict[str, float]:
    """Every figure of the run: the table is printed, the ratios returned."""
    with tempfile.TemporaryDirectory() as lone:
        with LocalCluster(3, db=db, snapshots=snapshots) as cluster, \
                LocalCluster(1, db=f"sqlite:///{lone}/agentkv.db", snapshots=f"{lone}/snapshots") as single:
            print(f"replica start-up: {[round(s, 1) for r in range(3) for s in cluster.startup_seconds(r)]} s")
            stay = stay_vs_single(cluster, single, opening, follow)
            moves = moved(cluster, db, snapshots, opening, follow[0], args.moves)
            count = "Count from one to one hundred in words, one per line."
            urls = [cluster.replica_url(i) for i in range(3)]
            decode_rate(urls, cluster.api_key, count)  # warm-up
            one = [decode_rate([urls[0]] * 3, cluster.api_key, count) for _ in range(2)]
            three = [decode_rate(urls, cluster.api_key, count) for _ in range(2)]
    runs = {**stay, **moves}
    print(f"{'path':>16} " + " ".join(f"{'ttft ms':>9}" for _ in range(max(len(v) for v in runs.values()))))
    for name, values in runs.items():
        print(f"{name:>16} " + " ".join(f"{1000 * v:9.0f}" for v in values))
    print(f"decode, 3 answers at once: one replica {statistics.median(one):.1f} tok/s, "
          f"one per replica {statistics.median(three):.1f} tok/s (2 cores shared by 3 replicas)")
    return {
        "moved_reprefill_over_moved_restore": statistics.median(moves["moved_reprefill"])
        / statistics.median(moves["moved_restore"]),
        "stay_over_single_server_ttft": statistics.median(stay["stay"]) / statistics.median(stay["single"]),
        "replicas_3_over_1_decode": statistics.median(three) / statistics.median(one),
    }


if __name__ == "__main__":
    main()
