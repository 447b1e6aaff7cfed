"""A long scripted conversation that outgrows its window, printing every compaction.

Runs on the scripted engine (no model needed, about a second): 30 user turns, some with a
tool call, under each context-window policy with ``max_prompt_len=600``. Every
``ContextCompacted`` event is printed, and what left the window is reported through the
conversation's ``on_window_change`` hook (where a store would flag it out-of-window)::

    python examples/long_chat.py                  # all three policies
    python examples/long_chat.py --policy sliding
"""

from __future__ import annotations

import argparse
import json

import anyio

from agentkv import Agent, Runtime, tool
from agentkv.run.conversation import Conversation, WindowEntry
from agentkv.events import ContextCompacted
from agentkv.policies import SlidingWindow, SummarizeAndReprefill, Truncation
from agentkv.testing import ScriptedCall, ScriptedEngine

POLICIES = {"truncation": Truncation, "sliding": SlidingWindow, "summarize": SummarizeAndReprefill}
TOPICS = ["the garden", "a trip to Porto", "the budget", "a birthday party", "the new laptop", "a book club"]


@tool
def weather(city: str) -> str:
    """Today's weather in ``city``."""
    return f"{city}: 19°C, light wind from the west, dry until the evening, rain likely overnight."


def user_message(turn: int) -> str:
    topic = TOPICS[turn % len(TOPICS)]
    return (
        f"Turn {turn}: let me tell you about {topic}. " + "It has been on my mind all week, and I keep "
        "going back and forth about what to do next. " * 2 + "What do you think?"
    )


def model_reply(call: ScriptedCall) -> str:
    """The scripted "model": weather questions get a tool call, summaries a summary, else advice."""
    if "Summarise this conversation" in call.prompt_text or "Rewrite the summary" in call.prompt_text:
        return "The user talked through several plans; the assistant gave short practical advice."
    this_turn = call.prompt_text.rsplit("<|im_start|>user\n", 1)[-1]
    if "Porto" in this_turn and "<|im_start|>tool" not in this_turn:
        return '<tool_call>\n{"name": "weather", "arguments": {"city": "Porto"}}\n</tool_call>'
    return "Take it one step at a time: write down the two options, pick the cheaper one, and revisit it next week."


async def run(policy_name: str, turns: int) -> None:
    engine = ScriptedEngine([model_reply] * 1000)
    agent = Agent(
        name=f"long-chat-{policy_name}",
        instructions="You are a calm, practical assistant.",
        tools=[weather],
        policy=POLICIES[policy_name](),
        max_prompt_len=600,
        min_response_len=64,
    )
    runtime = Runtime(engine)
    conversation = await runtime.open_conversation(agent)
    left: list[WindowEntry] = []

    async def on_window_change(
        conversation: Conversation, removed: list[WindowEntry], replacement: WindowEntry | None
    ) -> None:
        left.extend(removed)

    conversation.on_window_change = on_window_change
    print(f"== {policy_name} ==")
    for turn in range(1, turns + 1):
        async for event in runtime.run_stream(conversation, user_message(turn)):
            if isinstance(event, ContextCompacted):
                print(
                    f"turn {turn:2d}: {event.policy}: {event.tokens_before} → {event.tokens_after} tokens, "
                    f"{event.messages_removed} messages left the window ({event.cost_ms:.1f} ms)"
                )
    roles = [entry.message.role for entry in conversation.window]
    print(f"window now: {len(roles)} messages {json.dumps(roles)}; {len(left)} messages left it in total")
    if conversation.window and conversation.window[0].replaces:
        print(f"first message: {conversation.window[0].message.content[:90]!r}")
    print(f"KV shifted: {conversation.kv.shifted}\n")
    await runtime.aclose()


async def main(policies: list[str], turns: int) -> None:
    for name in policies:
        await run(name, turns)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--policy", choices=list(POLICIES), action="append")
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    anyio.run(main, args.policy or list(POLICIES), args.turns)
