"""Run it twice: the second run resumes the first run's session from its KV snapshot.

State lives in ./.agentkv-example/ (a SQLite database and snapshot files). The questions are the
demo's, whose answers hold on every CPU-plugin profile (tests/model/test_demo_model.py); the second
is asked after the resume, on the restored KV.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from agentkv import Agent, GenerationConfig, Runtime, open_engine
from agentkv.memory import Store

HOME = Path(".agentkv-example")
SESSION = "resume-example"
AGENT = Agent(name="resumer", instructions="You are a helpful assistant. Answer briefly.",
              generation=GenerationConfig(max_new_tokens=48))


async def main() -> None:
    HOME.mkdir(exist_ok=True)
    store = Store(f"sqlite:///{HOME / 'agentkv.db'}")
    runtime = Runtime(open_engine(), store, agents=[AGENT])
    ids = {s.id for s in await store.list_conversations()}
    if SESSION in ids:
        conversation = await runtime.resume(SESSION)
        report = conversation.resume_report
        print(f"resumed {SESSION}: {report.messages} messages; {report.restored_tokens} tokens of KV "
              "restored from the snapshot instead of re-prefilled")
        question = "Tell me one famous landmark there."
    else:
        conversation = await runtime.open_conversation(AGENT, conversation_id=SESSION)
        print(f"new session {SESSION} (run me again to resume it)")
        question = "What is the capital of France?"
    result = await runtime.run(conversation, question)
    m = result.call_metrics[0]
    print(f"user> {question}\nassistant> {result.final_text}")
    print(f"[reused {m.reused_tokens} tokens, prefilled {m.prefilled_tokens}]")
    await runtime.aclose()
    await store.close()


if __name__ == "__main__":
    anyio.run(main)
