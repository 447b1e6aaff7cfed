"""Subprocess side of the approval-across-a-restart test, on the real model; reports JSON.

    python tests/_approval_worker.py ask <db_url>                         # run until a call waits for approval
    python tests/_approval_worker.py approve <db_url> <session_id> <call_id>   # a new process: resume, approve
"""

from __future__ import annotations

import json
import os
import sys

import anyio

from agentkv import Agent, GenerationConfig, Runtime, tool
from agentkv.memory import Store


@tool(requires_approval=True)
def delete_file(path: str) -> str:
    """Delete a file.

    Args:
        path: The file to delete.
    """
    return f"deleted {path}"


AGENT = Agent(name="approver", instructions="You manage files with your tools.", tools=[delete_file],
              tool_choice="required", generation=GenerationConfig(max_new_tokens=48, temperature=0))


def runtime_on(url: str) -> tuple[Runtime, Store]:
    from agentkv.engine.factory import open_engine

    engine = open_engine(num_slots=1, backend=os.environ.get("AGENTKV_TEST_ENGINE", "paged"))
    store = Store(url)
    return Runtime(engine, store, agents=[AGENT]), store


async def ask(url: str) -> None:
    runtime, store = runtime_on(url)
    session = await runtime.open_conversation(AGENT)
    result = await runtime.run(session, "Delete the file notes.txt")
    print(json.dumps({"session": session.id, "finish": result.finish_reason, "kv_tokens": len(session.kv.tokens),
                      "calls": [c.id for c in result.pending_approvals]}))
    await runtime.aclose()
    await store.close()


async def approve(url: str, session_id: str, call_id: str) -> None:
    runtime, store = runtime_on(url)
    session = await runtime.resume(session_id)
    waiting = [c.id for c in runtime.pending_approvals(session)]
    result = await runtime.approve(session, call_id)
    m = result.call_metrics[0]
    print(json.dumps({"waiting": waiting, "restored": session.resume_report.restored_tokens,
                      "interrupted": session.resume_report.interrupted_calls, "finish": result.finish_reason,
                      "tool_result": [x.content for x in result.new_messages if x.role == "tool"],
                      "reused": m.reused_tokens, "prefilled": m.prefilled_tokens, "prompt": m.prompt_tokens}))
    await runtime.aclose()
    await store.close()


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    anyio.run({"ask": ask, "approve": approve}[mode], *args)
