"""Server TTFT: the 10-turn chat of ``multiturn.py`` through ``agentkv serve`` with the ``openai``
client (the whole history resent each turn, streamed) vs the same chat through the Python API,
and vs the same server with KV reuse off (``--no-kv-reuse``: a stateless server).

TTFT is measured the same way on every path: from sending the turn to the first streamed text.
Each path keeps its own answers (greedy). The servers run as subprocesses on loopback ports and
are measured one after the other. The last line is one JSON object:
``server_over_direct_ttft`` (median of turns 2–10; target ≤ 1.15) and
``stateless_server_over_agentkv_server_ttft_turn10`` (target ≥ 5).

Decode through the server (issue 47, item 7): a 128-token free-text answer (greedy, the server's
and the engine's default ``GenerationConfig``: prompt-lookup drafts on) streamed from the server with
the ``openai`` client, side by side with the same engine decoding the same prompt in this process
(``Runtime`` + ``open_engine``, ``run_stream``), alternating, ``--decode-repeats`` times each.
Decode tokens/s are the tokens after the first over the time from the first text to the last
(the server's tokens from ``usage``). ``server_decode_over_direct``: the median of the rounds'
server / in-process ratios (target ≥ 0.95; on a shared machine the load drifts between rounds,
not within one); ``server_decode_tok_s`` and ``direct_decode_tok_s``: each path's median.
Run: ``python benchmarks/server.py [--turns 10] [--decode-repeats 7] [--decode-only]``.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import openai
from _turns import SENTENCES, padded_turn

from agentkv import Agent, GenerationConfig, Runtime, RunFinished, TextDelta, open_engine
from _results import print_result

SYSTEM = "You are a helpful assistant that summarises text."
ANSWER_TOKENS = 64
DECODE_SYSTEM = "You are a helpful assistant."
DECODE_PROMPT = "Explain in detail how a bicycle's gear system works and why it makes climbing hills easier."
DECODE_TOKENS = 128


def user_turns(encode, turns: int) -> list[str]:
    return [padded_turn(encode, f"Turn {t}.", " Summarise this.", start=t, sentences=SENTENCES[:7], target=100)
            for t in range(1, turns + 1)]


async def direct(texts: list[str]) -> list[float]:
    """TTFT per turn through ``Runtime.run_stream`` on one session."""
    engine = open_engine()
    runtime = Runtime(engine)
    agent = Agent(name="bench", instructions=SYSTEM,
                  generation=GenerationConfig(max_new_tokens=ANSWER_TOKENS, temperature=0.0))
    session = await runtime.open_conversation(agent)
    ttfts = []
    for text in texts:
        started, first = time.perf_counter(), None
        async for event in runtime.run_stream(session, text):
            if first is None and isinstance(event, TextDelta) and event.text:
                first = time.perf_counter() - started
        ttfts.append(first if first is not None else time.perf_counter() - started)
    await runtime.aclose()
    return ttfts


@contextmanager
def server(*flags: str) -> Iterator[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "agentkv.cli.app", "serve", "--port", str(port), *flags],
                               stdout=subprocess.PIPE, text=True, env=dict(os.environ))
    assert process.stdout is not None
    line = ""
    while "serving" not in line and process.poll() is None:
        line = process.stdout.readline()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        process.terminate()
        process.wait(timeout=60)


def through_server(url: str, texts: list[str]) -> list[float]:
    """TTFT per turn through the server, the whole history resent each turn."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}]
    ttfts = []
    for text in texts:
        messages.append({"role": "user", "content": text})
        started, first, answer = time.perf_counter(), None, []
        for chunk in client.chat.completions.create(model="any", messages=messages, temperature=0,
                                                    max_tokens=ANSWER_TOKENS, stream=True):
            piece = chunk.choices[0].delta.content if chunk.choices else None
            if piece:
                if first is None:
                    first = time.perf_counter() - started
                answer.append(piece)
        ttfts.append(first if first is not None else time.perf_counter() - started)
        messages.append({"role": "assistant", "content": "".join(answer)})
    return ttfts


def decode_tok_s(tokens: int, first: float | None, last: float | None) -> float:
    """Decode tokens/s: the tokens after the first over the seconds from the first text to the last."""
    if first is None or last is None or last <= first or tokens < 2:
        raise RuntimeError(f"the answer decoded {tokens} tokens: too few to time its decode; pick a longer prompt")
    return (tokens - 1) / (last - first)


async def direct_decode(runtime: Runtime, agent: Agent) -> tuple[float, int]:
    """Decode tok/s (and tokens) of ``agent``'s answer to ``DECODE_PROMPT`` in process, on a new conversation."""
    conversation = await runtime.open_conversation(agent)
    first = last = None
    tokens = 0
    async for event in runtime.run_stream(conversation, DECODE_PROMPT):
        if isinstance(event, TextDelta) and event.text:
            last = time.perf_counter()
            first = first if first is not None else last
        elif isinstance(event, RunFinished):
            tokens = sum(m.generated_tokens for m in event.result.call_metrics)
    await runtime.close_conversation(conversation)
    return decode_tok_s(tokens, first, last), tokens


def server_decode(client: openai.OpenAI) -> tuple[float, int]:
    """Decode tok/s (and tokens) of the answer to ``DECODE_PROMPT`` streamed from the server."""
    messages = [{"role": "system", "content": DECODE_SYSTEM}, {"role": "user", "content": DECODE_PROMPT}]
    first = last = None
    tokens = 0
    for chunk in client.chat.completions.create(model="any", messages=messages, temperature=0,  # type: ignore[call-overload]
                                                max_tokens=DECODE_TOKENS, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            last = time.perf_counter()
            first = first if first is not None else last
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return decode_tok_s(tokens, first, last), tokens


def decode_side_by_side(url: str, repeats: int) -> dict[str, list[float]]:
    """Decode tok/s through the server at ``url`` and in process, alternating (after one warm-up each)."""
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)

    async def run() -> dict[str, list[float]]:
        runtime = Runtime(open_engine())
        agent = Agent(name="decode", instructions=DECODE_SYSTEM,
                      generation=GenerationConfig(max_new_tokens=DECODE_TOKENS, temperature=0.0))
        runs: dict[str, list[float]] = {"direct": [], "server": []}
        await direct_decode(runtime, agent)
        server_decode(client)
        for repeat in range(repeats):
            order = ("direct", "server") if repeat % 2 == 0 else ("server", "direct")
            for path in order:
                tok_s, tokens = await direct_decode(runtime, agent) if path == "direct" else server_decode(client)
                runs[path].append(tok_s)
                print(f"decode {path:>6}: {tok_s:6.1f} tok/s ({tokens} tokens)", flush=True)
        await runtime.aclose()
        return runs

    return anyio.run(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--decode-repeats", type=int, default=7)
    parser.add_argument("--decode-only", action="store_true", help="only the decode measure (no TTFT chat)")
    args = parser.parse_args()
    if args.decode_only:
        with server() as url:
            decoded = decode_side_by_side(url, args.decode_repeats)
        print_result(__file__, decode_figures(decoded), variant="decode")
        return
    from agentkv.engine.openvino.tokenizer import OVTokenizer
    from agentkv.engine.openvino.models import resolve_model

    texts = user_turns(OVTokenizer(resolve_model(None).ir_dir).encode, args.turns)
    runs = {"direct": anyio.run(direct, texts)}
    with server() as url:
        runs["server"] = through_server(url, texts)
        decoded = decode_side_by_side(url, args.decode_repeats)
    with server("--no-kv-reuse") as url:
        runs["stateless_server"] = through_server(url, texts)
    print(f"{'turn':>4} {'direct ms':>10} {'server ms':>10} {'stateless server ms':>20}")
    for turn, row in enumerate(zip(*runs.values()), start=1):
        print(f"{turn:4d} " + " ".join(f"{1000 * t:{w}.1f}" for t, w in zip(row, (10, 10, 20))))
    later = slice(1, None)  # turn 1 is a cold prefill everywhere
    result = {
        "server_over_direct_ttft": statistics.median(runs["server"][later]) / statistics.median(runs["direct"][later]),
        "stateless_server_over_agentkv_server_ttft_turn10": runs["stateless_server"][-1] / runs["server"][-1],
    }
    print_result(__file__, {**{k: round(v, 3) for k, v in result.items()}, **decode_figures(decoded)})


def decode_figures(decoded: dict[str, list[float]]) -> dict[str, float]:
    """The decode measure's JSON figures: the median of each round's server / in-process ratio (a
    round's two runs are seconds apart: a load that drifts over the run cancels out) and the
    median tok/s of each path."""
    ratios = [server / direct for server, direct in zip(decoded["server"], decoded["direct"])]
    return {"server_decode_over_direct": round(statistics.median(ratios), 3),
            "server_decode_tok_s": round(statistics.median(decoded["server"]), 1),
            "direct_decode_tok_s": round(statistics.median(decoded["direct"]), 1)}


if __name__ == "__main__":
    main()
