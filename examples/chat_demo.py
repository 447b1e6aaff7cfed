"""`make demo`: an agent on the default local model answers, streamed through an explicit KV session.

Shows the KV session at work: the second question prefills only its own tokens.
"""

from __future__ import annotations

import anyio

from agentkv import Agent, GenerationConfig, Runtime, open_engine


async def main() -> None:
    engine = open_engine()
    agent = Agent(
        name="demo",
        instructions="You are a helpful assistant. Answer in two sentences.",
        generation=GenerationConfig(max_new_tokens=80),
    )
    runtime = Runtime(engine)
    session = await runtime.open_session(agent)
    for question in ("What is the capital of France?", "And what is it famous for?"):
        print(f"\nuser> {question}\nassistant> ", end="", flush=True)
        async for event in runtime.run_stream(session, question):
            if event.type == "text_delta":
                print(event.text, end="", flush=True)
            elif event.type == "turn_metrics":
                m = event.metrics
                print(
                    f"\n  [prompt {m.prompt_tokens} tokens: reused {m.reused_tokens}, prefilled "
                    f"{m.prefilled_tokens}; generated {m.generated_tokens}; TTFT {m.ttft_s * 1000:.0f} ms, "
                    f"{1 / m.tpot_s if m.tpot_s else 0:.0f} tok/s; KV {m.kv_bytes / 1024:.0f} KiB]"
                )
    await runtime.aclose()


if __name__ == "__main__":
    anyio.run(main)
