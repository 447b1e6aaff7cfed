"""The approval-across-a-restart test's agent, and the new process's side of it on the real model; reports JSON.

    python tests/_approval_worker.py approve <db_url> <conversation_id> <call_id>   # a new process: resume, approve

The test asks in its own process (``ask`` on the suite's engine) until the call waits for approval,
then runs this file: the second process, which resumes the session from the store and its KV snapshot.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

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


async def ask(engine: Any, url: str) -> dict[str, Any]:
    """Run on ``engine`` until the call waits for approval: ``await ask(engine, "sqlite:///a.db")``."""
    store = Store(url)
    runtime = Runtime(engine, store, agents=[AGENT])
    session = await runtime.open_conversation(AGENT)
    result = await runtime.run(session, "Delete the file notes.txt")
    asked = {"session": session.id, "finish": result.finish_reason, "kv_tokens": len(session.kv.tokens),
             "calls": [c.id for c in result.pending_approvals]}
    await runtime.aclose()
    await store.close()
    return asked


async def approve(url: str, conversation_id: str, call_id: str) -> None:
    from agentkv.engine.factory import open_engine

    # NOTE: the default backend, on one graph: what is checked here (the KV restored and reused, the
    # result alone prefilled) does not depend on which graph feeds a step, and each graph not
    # compiled saves this process ~3.5 CPU-s
    engine = open_engine(num_slots=1, backend=os.environ.get("AGENTKV_TEST_ENGINE", "paged"), chunk_graph=False)
    store = Store(url)
    runtime = Runtime(engine, store, agents=[AGENT])
    session = await runtime.resume(conversation_id)
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
    anyio.run({"approve": approve}[mode], *args)
