"""Subprocess side of the fault-injection tests: run a stored conversation to one phase of a turn,
print "ready", and wait there to be killed with SIGKILL.

    python tests/_fault_worker.py <phase> <db_url> <conversation_id>

Phases: prefill, decode, tool, snapshot (a snapshot file half written), summary (inside the
transaction that appends a summary and marks what it replaces). The agent and the scripted
model are shared with the test, which resumes the session in its own process.
"""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import anyio

from agentkv import Agent, Runtime, tool
from agentkv.memory import Store
from agentkv.policies import SummarizeAndReprefill
from agentkv.testing import ScriptedEngine
from agentkv.testing.scripted import ScriptedCall

SLOW = {"tool": False, "announce": False}
"""Set by the worker: the tool hangs; the model says "ready" when a call reaches it."""
LONG_TURN = "Tell me more about it, please. " * 40
BACKGROUND_TURN = "Here is some background for you. " * 45
"""With LONG_TURN after it, the prompt outgrows the budget: the policy summarises the oldest turns."""
FIRST_TURN = "hello there"


def ready() -> None:
    print("ready", flush=True)


def hang() -> None:
    """Block this thread until the process is killed (the test kills it within seconds)."""
    ready()
    time.sleep(600)


@tool
async def lookup(topic: str) -> str:
    """Look a topic up."""
    if SLOW["tool"]:
        ready()
        await anyio.sleep(600)
    return f"facts about {topic}"


def fault_agent() -> Agent:
    return Agent(
        name="fault",
        instructions="You are a terse assistant. Use lookup for facts.",
        tools=[lookup],
        policy=SummarizeAndReprefill(max_summary_tokens=24, chunk_tokens=200),
        max_prompt_len=700,
        min_response_len=32,
    )


AGENT = fault_agent()


def respond(call: ScriptedCall) -> str:
    """The scripted model: summaries for the summariser; for a user turn that says "look up", a
    lookup call until two results are in; else a short answer."""
    if SLOW["announce"]:
        ready()
    text = call.prompt_text
    if "Summarise this conversation" in text:
        return "The user greeted and asked questions."
    exchange = current_exchange(text)
    results = exchange.count("<|im_start|>tool") + exchange.count("<tool_response>")
    if "look up" in exchange and results < 2:  # a 3-step loop: call, call, answer
        topic = ("tides", "moon")[results]
        return f'<tool_call>\n{{"name": "lookup", "arguments": {{"topic": "{topic}"}}}}\n</tool_call>'
    return f"Answer number {call.index}."


def current_exchange(prompt: str) -> str:
    """The prompt from the newest user message (not a tool result rendered as a user turn) on."""
    turns = prompt.split("<|im_start|>")
    for i in range(len(turns) - 1, 0, -1):
        if turns[i].startswith("user\n") and not turns[i][5:].startswith("<tool_response>"):
            return "<|im_start|>".join(turns[i:])
    return prompt


def scripted_engine(**delays: float) -> ScriptedEngine:
    return ScriptedEngine([respond] * 64, **delays)


async def run_to(phase: str, url: str, conversation_id: str) -> None:
    engine = scripted_engine()
    runtime = Runtime(engine, Store(url), agents=[AGENT])
    session = await runtime.open_conversation(AGENT, conversation_id=conversation_id)
    await runtime.run(session, FIRST_TURN)
    text = "please look up the tides" if phase == "tool" else "and another question"
    if phase == "prefill":
        engine.prefill_s_per_token = 0.5  # the model call says "ready", then prefills for seconds
        SLOW["announce"] = True
    elif phase == "decode":
        engine.decode_s_per_token = 0.3
    elif phase == "tool":
        SLOW["tool"] = True
    elif phase == "snapshot":
        from agentkv.kv import snapshot as snapshot_module

        def half_write(self, path):  # a temp file begins, then the process dies
            target = Path(path)
            (target.parent / f".{target.name}.partial.tmp").write_bytes(b"AGKVSNAP")
            hang()

        snapshot_module.KVSnapshot.to_file = half_write
    elif phase == "blocks":  # the turn's new blocks queued for the disk tier when the process dies
        from agentkv.kvstore.block_files import DiskBlocks

        said = threading.Lock()

        def stuck_write(self, key, data):  # several writer threads: one says "ready"
            if said.acquire(blocking=False):
                ready()
            time.sleep(600)

        DiskBlocks.put = stuck_write
        text = LONG_TURN
    elif phase == "summary":
        from agentkv.memory import queries

        original = queries.mark_out_of_window

        def stuck(*args, **kwargs):  # inside the append-and-mark transaction
            hang()
            return original(*args, **kwargs)

        queries.mark_out_of_window = stuck
        await runtime.run(session, BACKGROUND_TURN)
        text = LONG_TURN
    async for event in runtime.run_stream(session, text):
        if phase == "decode" and event.type == "text_delta":
            ready()
    print("finished without being killed", flush=True)


if __name__ == "__main__":
    anyio.run(run_to, sys.argv[1], sys.argv[2], sys.argv[3])
