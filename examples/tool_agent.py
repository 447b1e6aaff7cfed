"""An agent with the calculator and the clock on the default model: streamed events and per-step metrics.

The first step is grammar-constrained to a valid tool call (tool_choice="required"); the
second step reads the tool result on top of the same KV session.
"""

from __future__ import annotations

import anyio

from agentkv import Agent, GenerationConfig, Runtime, open_engine, calculator, clock


async def main() -> None:
    engine = open_engine()
    agent = Agent(
        name="tools",
        instructions="You are an assistant that uses tools for arithmetic and for the time.",
        tools=[calculator, clock],
        tool_choice="required",
        generation=GenerationConfig(max_new_tokens=64),
        max_turns=3,
    )
    runtime = Runtime(engine)
    session = await runtime.open_session(agent)
    async for event in runtime.run_stream(session, "What is 123 * 45?"):
        if event.type == "text_delta":
            print(event.text, end="", flush=True)
        elif event.type == "tool_call":
            print(f"→ {event.call.name}({event.call.arguments})")
        elif event.type == "tool_result":
            print(f"← {event.content}{' (error)' if event.is_error else ''}")
        elif event.type == "turn_metrics":
            m = event.metrics
            print(f"\n  [step {event.step}: reused {m.reused_tokens}, prefilled {m.prefilled_tokens}, "
                  f"generated {m.generated_tokens}, TTFT {m.ttft_s * 1000:.0f} ms]")
    await runtime.aclose()


if __name__ == "__main__":
    anyio.run(main)
