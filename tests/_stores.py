"""What the Store tests share: a session of a stored agent, a random snapshot, and a lease race
between processes: ``sid = await new_conversation(store)``; ``await race_for_lease(url, tmp, sid, ["a", "b"])``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import anyio
import numpy as np

from agentkv.chat.messages import Message, ToolCall
from agentkv.kv.snapshot import KVSnapshot
from agentkv.memory import Store

REPO = Path(__file__).resolve().parents[1]
FP = "test-model|kv:u8"


async def new_conversation(store: Store, conversation_id: str | None = None) -> str:
    """A new conversation of the stored agent "helper" (stored or updated first):
    ``sid = await new_conversation(store)``."""
    await store.upsert_agent("helper", "Be brief.", ["calc"], {"temperature": 0})
    return (await store.create_conversation("helper", conversation_id=conversation_id)).id


def make_snapshot(num_tokens: int, seed: int = 0, fingerprint: str = FP) -> KVSnapshot:
    """A random u8 snapshot of tokens ``0..num_tokens-1``: ``make_snapshot(4, seed=1)``."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((2, 1, 3, num_tokens, 64), dtype=np.float32)
    return KVSnapshot.from_float(range(num_tokens), keys, -keys, precision="u8",
                                 fingerprint=fingerprint)


RACE_WORKER = """
import os, sys, time, anyio
from agentkv.errors import ConversationBusy
from agentkv.memory import Store

url, snapshot_dir, conversation_id, holder, go_file = sys.argv[1:6]
store = Store(url, snapshot_dir=snapshot_dir)

async def main():
    await store.get_conversation(conversation_id)  # connect and check the schema before the start line
    print("ready", flush=True)
    while not os.path.exists(go_file):
        time.sleep(0.001)
    try:
        await store.acquire_lease(conversation_id, holder, ttl_s=60)
        print("won", flush=True)
    except ConversationBusy:
        print("busy", flush=True)

anyio.run(main)
"""


async def race_for_lease(store_url: str, tmp_path: Path, sid: str, holders: list[str]) -> list[tuple[str, str]]:
    """Start one process per holder, release them together, return each (stdout, stderr)."""
    go_file = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    workers = [
        subprocess.Popen([sys.executable, "-c", RACE_WORKER, store_url, str(tmp_path / "s"), sid, holder,
                          str(go_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for holder in holders
    ]
    try:
        for worker in workers:
            assert worker.stdout is not None
            assert await anyio.to_thread.run_sync(worker.stdout.readline) == "ready\n"
        go_file.touch()
        return [await anyio.to_thread.run_sync(lambda w=w: w.communicate(timeout=60)) for w in workers]
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()


CALL = ToolCall(id="call_1", name="calc", arguments={"expr": "1+1"})
CONVERSATION = [
    Message.system("Be brief."),
    Message.user("what is 1+1?"),
    Message.assistant("", tool_calls=[CALL], token_ids=[5, 6, 7]),
    Message.tool("2", tool_call_id="call_1", name="calc"),
    Message.assistant("2", token_ids=[9]),
]


async def append_all(store: Store, sid: str, messages: list[Message]) -> None:
    """Append ``messages`` in order, token counts 10, 11, …: ``await append_all(store, sid, CONVERSATION)``."""
    for i, message in enumerate(messages):
        await store.append_message(sid, message, token_count=10 + i)
