"""An agent with the calculator and the clock on the default model: streamed events and per-model-call metrics.

The first model call is grammar-constrained to one valid tool call (tool_choice="required",
parallel_tool_calls=False); the second reads the tool result on top of the same KV
session. The default model (SmolLM2-135M) writes the right call (``calculator({"expression":
"123 * 45"})``) but does not read a result back: it echoes it in ``<tool_response>`` markup,
so the answer's model call stops there and the tool's result is the answer. A model that reads
results back (``AGENTKV_MODEL``) runs without the stop string.
"""

from __future__ import annotations

import anyio

from agentkv import Agent, GenerationConfig, Runtime, calculator, clock, open_engine

AGENT = Agent(
    name="tools",
    instructions="Use tools for arithmetic and for the time.",
    tools=[calculator, clock],
    tool_choice="required",
    parallel_tool_calls=False,
    generation=GenerationConfig(max_new_tokens=64, stop_strings=("<tool_response>",)),
    max_model_calls=3,
)
QUESTION = "What is 123 * 45?"


async def main() -> None:
    engine = open_engine()
    runtime = Runtime(engine)
    conversation = await runtime.open_conversation(AGENT)
    print(f"user> {QUESTION}")
    async for event in runtime.run_stream(conversation, QUESTION):
        if event.type == "text_delta":
            print(event.text, end="", flush=True)
        elif event.type == "tool_called":
            print(f"→ {event.call.name}({event.call.arguments})")
        elif event.type == "tool_returned":
            print(f"← {event.content}{' (error)' if event.is_error else ''}")
        elif event.type == "model_call_finished":
            m = event.metrics
            print(f"  [model call {event.call_index}: reused {m.reused_tokens}, prefilled {m.prefilled_tokens}, "
                  f"generated {m.generated_tokens}, TTFT {m.ttft_s * 1000:.0f} ms]")
    await runtime.aclose()
    await engine.aclose()


if __name__ == "__main__":
    anyio.run(main)
