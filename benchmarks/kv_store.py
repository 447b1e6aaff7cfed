"""The KV store: bytes a turn writes, a shared prompt stored once, a turn on S3, a moved conversation's restore.

Four measures, side by side in one run, on one engine (``--model``: the default model, or any
model agentkv opens, e.g. a 1.5B-class zoo build):

- ``turn_bytes_over_new_kv``: a ``--turns``-turn conversation (~``--turn-tokens``-token user turns,
  32-token answers) on a store with a snapshot directory; the bytes its saves wrote (new blocks and
  tail files) over the KV of all its tokens (target ≤ 1.25). Beside it, what whole snapshots
  (the store before keyed blocks) would have written.
- ``shared_prefix_bytes_ratio``: ``--agents`` conversations sharing a ``--prompt-tokens`` system
  prompt, ``--agent-turns`` turns each; the bytes the store holds after (blocks + tail files of the
  kept snapshots) over one prompt's KV + each conversation's own tokens' KV (target ≤ 1.1).
- ``replica_turn_over_lone_turn``: whole turns (TTFT + 32 tokens + what the run waits for to save)
  on a store with PostgreSQL + S3 against one with SQLite + files, alternated (target ≤ 1.1). Needs
  ``AGENTKV_TEST_POSTGRES_URL`` and ``AGENTKV_TEST_S3_URL`` (+ ``AWS_*``); skipped without them.
- ``moved_reprefill_over_moved_restore``: a ~``--history``-token conversation saved to S3 is resumed
  by a store that never saw it (empty host tier: another replica) and answers one turn; its TTFT
  against the same resume with its snapshots deleted (a re-prefill) (target ≥ 5 at ~2K).

The last line is one JSON object of these ratios (and the figures behind them).
Run: ``python benchmarks/kv_store.py [--turns 30] [--agents 32] [--model PATH]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import anyio
from _sized_models import model_arg, sized_model_names
from _turns import padded_turn

from agentkv import Agent, GenerationConfig, Runtime
from agentkv.engine.factory import open_engine
from agentkv.memory import Store
from _results import print_result

ANSWER = GenerationConfig(max_new_tokens=32)
SHORT = GenerationConfig(max_new_tokens=16)
RESERVE = 256
"""Tokens of the context a prompt leaves for the answer (the agent's default ``max_new_tokens``)."""


def user_turn(engine, i: int, tokens: int) -> str:
    return padded_turn(engine.tokenizer.encode, f"Part {i}: please summarise this.", " Thank you.",
                       start=i, step=3, target=tokens)


def written_bytes(store: Store) -> int:
    """Bytes the store's persistent tiers have written, plus its tail files on disk (each save writes one)."""
    store.blocks.flush(120)
    usage = store.blocks.usage().write_behind
    return 0 if usage is None else usage.written_bytes


def directory_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fitting_turn_tokens(engine, turns: int, wanted: int = 335) -> int:
    """``wanted`` tokens a user turn, or fewer so that ``turns`` turns with their answers and template
    markup (~55 tokens a turn beyond the user's on the default model, its answer included) fit the
    model's context less the answer's reserve (the default model's 8K holds 30 turns of ~190 tokens)."""
    per_turn = (engine.max_context_len - RESERVE) // turns - ANSWER.max_new_tokens - 40
    return max(32, min(wanted, per_turn))


async def turn_bytes(engine, turns: int, turn_tokens: int, workdir: Path, block_size: int = 32) -> dict:
    store = Store(f"sqlite:///{workdir / 'turns.db'}", snapshot_dir=workdir / "turns", block_size=block_size)
    runtime = Runtime(engine, store)
    agent = Agent(name="notes", instructions="You summarise what the user sends.", generation=ANSWER)
    conversation = await runtime.open_conversation(agent)
    tails = whole = per_token = 0
    for i in range(turns):
        await runtime.run(conversation, user_turn(engine, i, turn_tokens))
        newest = (await store.snapshots(conversation.id))[0]
        tails += newest.nbytes
        per_token = per_token or (await conversation.kv.snapshot()).bytes_per_token
        whole += newest.num_tokens * per_token
    blocks = written_bytes(store)
    kv = newest.num_tokens * per_token
    await runtime.aclose()
    await store.close()
    print(f"{turns} turns, {newest.num_tokens} tokens of KV ({kv / 1e6:.1f} MB at {per_token} B/token): "
          f"wrote {blocks / 1e6:.1f} MB of blocks + {tails / 1e6:.1f} MB of tail files; "
          f"whole snapshots would have written {whole / 1e6:.1f} MB")
    return {"turn_bytes_over_new_kv": (blocks + tails) / kv, "whole_snapshot_bytes_over_new_kv": whole / kv,
            "kv_tokens": newest.num_tokens, "bytes_per_token": per_token}


async def shared_prefix(engine, agents: int, prompt_tokens: int, agent_turns: int, workdir: Path,
                        block_size: int = 32) -> dict:
    store = Store(f"sqlite:///{workdir / 'shared.db'}", snapshot_dir=workdir / "shared", block_size=block_size)
    runtime = Runtime(engine, store)
    prompt = padded_turn(engine.tokenizer.encode, "You are a careful assistant. House rules follow.", "",
                         start=0, target=prompt_tokens)
    agent = Agent(name="shared", instructions=prompt, generation=SHORT)
    own_tokens = 0
    per_token = 0
    for a in range(agents):
        conversation = await runtime.open_conversation(agent)
        for t in range(agent_turns):
            await runtime.run(conversation, f"Agent {a}, question {t}: what is {a} plus {t}?")
        snap = await conversation.kv.snapshot()
        per_token = per_token or snap.bytes_per_token
        own_tokens += snap.num_tokens - len(engine.tokenizer.encode(prompt))
        await runtime.close_conversation(conversation)
    store.blocks.flush(120)
    stored = directory_bytes(workdir / "shared")
    prompt_kv = len(engine.tokenizer.encode(prompt)) * per_token
    floor = prompt_kv + own_tokens * per_token
    await runtime.aclose()
    await store.close()
    print(f"{agents} conversations sharing a {prompt_kv // per_token}-token prompt: the store holds "
          f"{stored / 1e6:.1f} MB against {floor / 1e6:.1f} MB of distinct KV "
          f"(whole snapshots: ~{(agents * prompt_kv + own_tokens * per_token) / 1e6:.1f} MB)")
    return {"shared_prefix_bytes_ratio": stored / floor}


async def replica_turns(engine, turns: int, turn_tokens: int, workdir: Path) -> dict:
    pg, s3 = os.environ.get("AGENTKV_TEST_POSTGRES_URL"), os.environ.get("AGENTKV_TEST_S3_URL")
    if not pg or not s3:
        print("replica turn: skipped (set AGENTKV_TEST_POSTGRES_URL and AGENTKV_TEST_S3_URL)")
        return {}
    lone = Store(f"sqlite:///{workdir / 'lone.db'}", snapshot_dir=workdir / "lone")
    replica = Store(pg, snapshots=f"{s3.rstrip('/')}/bench-{os.getpid()}-{int(time.time())}")
    agent = Agent(name="turns", instructions="You summarise what the user sends.", generation=ANSWER)
    sides = {"lone": (lone, Runtime(engine, lone)), "replica": (replica, Runtime(engine, replica))}
    conversations = {name: await runtime.open_conversation(agent) for name, (_, runtime) in sides.items()}
    seconds: dict[str, list[float]] = {"lone": [], "replica": []}
    for i in range(turns):
        for name in (("lone", "replica") if i % 2 else ("replica", "lone")):
            runtime = sides[name][1]
            started = time.perf_counter()
            await runtime.run(conversations[name], user_turn(engine, i, turn_tokens))
            seconds[name].append(time.perf_counter() - started)
    flush_started = time.perf_counter()
    replica.blocks.flush(120)
    flush = time.perf_counter() - flush_started
    moved = await moved_restore(engine, replica, pg, s3, conversations["replica"].id, agent)
    for store, runtime in sides.values():
        await runtime.aclose()
        await store.close()
    lone_s, replica_s = statistics.median(seconds["lone"][1:]), statistics.median(seconds["replica"][1:])
    print(f"whole turn, median of {turns - 1}: replica (PostgreSQL + S3) {replica_s * 1000:.0f} ms, "
          f"lone (SQLite + files) {lone_s * 1000:.0f} ms; the queue then drained in {flush * 1000:.0f} ms")
    return {"replica_turn_over_lone_turn": replica_s / lone_s, **moved}


async def moved_restore(engine, source: Store, pg: str, s3: str, conversation_id: str, agent: Agent) -> dict:
    """Resume ``conversation_id`` from a store that never held it (another replica), one turn: TTFT
    restored from S3 against TTFT re-prefilled (its snapshots hidden)."""
    ttft: dict[str, float] = {}
    for mode in ("restore", "reprefill", "restore"):
        other = Store(pg, snapshots=source.files.url, kv_host_bytes=0)  # type: ignore[attr-defined]
        runtime = Runtime(engine, other)
        if mode == "reprefill":
            for record in await other.snapshots(conversation_id):
                await other.delete_snapshot(record)
        conversation = await runtime.resume(conversation_id, agent)
        result = await runtime.run(conversation, "One more line, please.")
        metrics = result.call_metrics[0]
        ttft[mode] = min(ttft.get(mode, float("inf")), metrics.ttft_s)
        history = metrics.prompt_tokens
        await runtime.aclose()
        await other.close()
    print(f"moved conversation ({history} tokens): restored from S3 {ttft['restore'] * 1000:.0f} ms TTFT, "
          f"re-prefilled {ttft['reprefill'] * 1000:.0f} ms")
    return {"moved_reprefill_over_moved_restore": ttft["reprefill"] / ttft["restore"], "moved_history": history}


async def main_async(args: argparse.Namespace) -> dict:
    engine = open_engine(model_arg(args.model)) if args.model else open_engine()
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="agentkv-kvstore-") as tmp:
        work = Path(tmp)
        out.update(await turn_bytes(engine, args.turns, args.turn_tokens or fitting_turn_tokens(engine, args.turns),
                                    work, args.block_size))
        out.update(await shared_prefix(engine, args.agents, args.prompt_tokens, args.agent_turns, work,
                                       args.block_size))
        if not args.bytes_only:
            out.update(await replica_turns(engine, args.replica_turns, args.history // args.replica_turns, work))
    await engine.aclose()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a model path open_engine takes, or a realistic-size model's name "
                        f"({', '.join(sized_model_names())}: built on demand; default: the default model)")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--turn-tokens", type=int, default=None,
                        help="tokens of each user turn (default: 335, or less so that --turns fit the model's context)")
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--agent-turns", type=int, default=4)
    parser.add_argument("--history", type=int, default=2000, help="tokens of the replica conversation")
    parser.add_argument("--replica-turns", type=int, default=6)
    parser.add_argument("--block-size", type=int, default=32, help="tokens per stored block (a multiple of 32)")
    parser.add_argument("--bytes-only", action="store_true", help="only the two byte ratios (no timings)")
    args = parser.parse_args()
    out = anyio.run(main_async, args)
    print_result(__file__, {k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()})


if __name__ == "__main__":
    main()
