"""`make demo`: an agent on the default local model answers, streamed through an explicit KV session.

Shows the KV session at work: the second question prefills only its own tokens.

The instructions and questions are chosen so the answers hold on every CPU-plugin profile
(bf16 compute on CPUs with avx512_bf16/AMX, dynamic quantisation on avx512, plain f32
elsewhere): a 135M model's answer to an open prompt can be a near-tie that the numerics flip
("Answer in two sentences." made the first token a 0.1-logit tie, answered "La Dnор …" in
bf16). ``tests/model/test_demo_model.py`` runs ``converse`` under the three profiles.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from agentkv import Agent, GenerationConfig, Runtime, open_engine
from agentkv.engine.base import Engine
from agentkv.events import RunEvent

QUESTIONS = ("What is the capital of France?", "Tell me one famous landmark there.")
AGENT = Agent(
    name="demo",
    instructions="You are a helpful assistant. Answer briefly.",
    generation=GenerationConfig(max_new_tokens=80),
)


def show(event: RunEvent) -> None:
    """Print the answer as it streams, then the model call's KV figures."""
    if event.type == "text_delta":
        print(event.text, end="", flush=True)
    elif event.type == "model_call_finished":
        m = event.metrics
        print(
            f"\n  [prompt {m.prompt_tokens} tokens: reused {m.reused_tokens}, prefilled "
            f"{m.prefilled_tokens}; generated {m.generated_tokens}; TTFT {m.ttft_s * 1000:.0f} ms, "
            f"{1 / m.tpot_s if m.tpot_s else 0:.0f} tok/s; KV {m.kv_bytes / 1024:.0f} KiB]"
        )


async def converse(engine: Engine, on_event: Callable[[RunEvent], None] = show) -> list[str]:
    """Ask ``QUESTIONS`` in one conversation with ``AGENT`` on ``engine``; the answers, in order."""
    runtime = Runtime(engine)
    conversation = await runtime.open_conversation(AGENT)
    answers = []
    for question in QUESTIONS:
        print(f"\nuser> {question}\nassistant> ", end="", flush=True)
        text = ""
        async for event in runtime.run_stream(conversation, question):
            on_event(event)
            if event.type == "text_delta":
                text += event.text
        answers.append(text)
    await runtime.close_conversation(conversation)
    return answers


async def main() -> None:
    engine = open_engine()
    await converse(engine)
    await engine.aclose()


if __name__ == "__main__":
    anyio.run(main)
