"""Server TTFT: the 10-turn chat of ``multiturn.py`` through ``agentkv serve`` with the ``openai``
client (the whole history resent each turn, streamed) vs the same chat through the Python API,
and vs the same server with KV reuse off (``--no-kv-reuse``: a stateless server).

TTFT is measured the same way on every path: from sending the turn to the first streamed text.
Each path keeps its own answers (greedy). The servers run as subprocesses on loopback ports and
are measured one after the other. The last line is one JSON object:
``server_over_direct_ttft`` (median of turns 2–10; target ≤ 1.15) and
``stateless_server_over_agentkv_server_ttft_turn10`` (target ≥ 5).
Run: ``python benchmarks/server.py [--turns 10]``.
"""

from __future__ import annotations

import argparse
import json
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

from agentkv import Agent, GenerationConfig, Runtime, TextDelta, open_engine

SYSTEM = "You are a helpful assistant that summarises text."
ANSWER_TOKENS = 64


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=10)
    args = parser.parse_args()
    from agentkv.engine.openvino.tokenizer import OVTokenizer
    from agentkv.engine.openvino.models import resolve_model

    texts = user_turns(OVTokenizer(resolve_model(None).ir_dir).encode, args.turns)
    runs = {"direct": anyio.run(direct, texts)}
    with server() as url:
        runs["server"] = through_server(url, texts)
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
    print(json.dumps({k: round(v, 3) for k, v in result.items()}))


if __name__ == "__main__":
    main()
