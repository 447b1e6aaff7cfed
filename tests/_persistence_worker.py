"""Subprocess side of the persistence tests: runs one turn against a store and reports as JSON.

    python tests/_persistence_worker.py slow-turn <db_url> <conversation_id>
    python tests/_persistence_worker.py resume-turn <db_url> <conversation_id> <text> [max_new_tokens]

``slow-turn``: a scripted, slow turn, to be killed or to hold the lease; ``resume-turn``: the real
model resumes the session, runs ``text`` and prints the call's metrics.

``max_new_tokens`` (optional) caps the answers of the resumed agent as the test capped the original's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import anyio

from agentkv import Agent, Runtime
from agentkv.memory import Store

AGENT = Agent(name="persist", instructions="You are a terse assistant.")


async def slow_turn(url: str, conversation_id: str) -> None:
    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["word " * 400], decode_s_per_token=0.02)
    store = Store(url)
    runtime = Runtime(engine, store, agents=[AGENT], lease_ttl_s=1.0)
    session = await runtime.open_conversation(AGENT, conversation_id=conversation_id)
    print("started", flush=True)
    await runtime.run(session, "tell me everything")


async def resume_turn(url: str, conversation_id: str, text: str, max_new_tokens: str | None = None) -> None:
    from agentkv.engine.factory import open_engine

    agent = AGENT if max_new_tokens is None else dataclasses.replace(
        AGENT, generation=AGENT.generation.model_copy(update={"max_new_tokens": int(max_new_tokens)}))

    # NOTE: the same backend as the test's engine fixture (snapshots do not cross backends), on one
    # graph as _approval_worker.py's: the restore and its reuse do not depend on which graph feeds a
    # step, and the graphs not compiled save this process ~8 CPU-s
    engine = open_engine(num_slots=1, backend=os.environ.get("AGENTKV_TEST_ENGINE", "paged"), chunk_graph=False)
    store = Store(url)
    runtime = Runtime(engine, store, agents=[agent])
    session = await runtime.resume(conversation_id)
    result = await runtime.run(session, text)
    m = result.call_metrics[0]
    print(json.dumps({
        "text": result.final_text,
        "token_ids": list(session.messages[-1].token_ids or ()),
        "restored": session.resume_report.restored_tokens,
        "reused": m.reused_tokens,
        "prefilled": m.prefilled_tokens,
        "prompt": m.prompt_tokens,
    }))
    await runtime.aclose()
    await store.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    anyio.run({"slow-turn": slow_turn, "resume-turn": resume_turn}[mode], *args)
