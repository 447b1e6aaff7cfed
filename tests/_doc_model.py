"""The stand-in model the docs' code runs on in the fast suite: ``open_engine`` gives a
``ScriptedEngine`` whose replies follow the guides' questions (a tool call where a guide asks for
one, JSON where it asks for structured output, a result read back after a tool), so every block
runs the real runtime, store and server code without a model::

    with scripted_open_engine() as engines:
        engine = agentkv.open_engine()            # a ScriptedEngine; engines[-1] is it
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from agentkv.engine import factory
from agentkv.testing import ScriptedCall, ScriptedEngine

REPLIES_PER_ENGINE = 2_000


def tool_call(name: str, **arguments: Any) -> str:
    """A call in the scripted tokenizer's (SmolLM2's Hermes) format."""
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


ANSWERS = {
    "17 * 23": tool_call("calculator", expression="17 * 23"),
    "What is 2 + 3?": tool_call("add", a=2, b=3),
    "Weather in Paris?": tool_call("get_weather", city="Paris"),
    "Delete a.txt": tool_call("delete_file", path="a.txt"),
    "Which city has the Eiffel Tower?": '{"name": "Paris", "country": "France"}',
    "Weather in Oslo?": tool_call("get_weather", city="Oslo"),
    "Oslo is at 3 C.": '{"city": "Oslo", "temperature_c": 3}',
    "capital of France": "The capital of France is Paris.",
    "famous landmark": "The Eiffel Tower.",
}
"""What the stand-in answers to a guide's question (the last user message holding the key)."""
DEFAULT_ANSWER = ("Here is a short, practical answer: start with the smallest step, note what you learn, "
                  "and come back to it next week.")
SUMMARY = "The user and the assistant talked through several plans; the assistant gave short practical advice."


def last_turn(prompt: str) -> tuple[str, str]:
    """The role and content of the last message of a ChatML prompt (before the generation prompt)."""
    turns = [t for t in prompt.split("<|im_start|>") if t.strip()]
    done = [t for t in turns if "<|im_end|>" in t]
    role, _, content = done[-1].partition("\n")
    return role.strip(), content.split("<|im_end|>", 1)[0]


def reply(call: ScriptedCall) -> str:
    """The stand-in's answer to one model call."""
    if "Summarise this conversation" in call.prompt_text or "Rewrite the summary" in call.prompt_text:
        return SUMMARY
    role, content = last_turn(call.prompt_text)
    if role == "tool":
        return f"The tool answered: {content.strip()}."
    return next((answer for key, answer in ANSWERS.items() if key in content), DEFAULT_ANSWER)


@contextmanager
def scripted_open_engine() -> Iterator[list[ScriptedEngine]]:
    """Replace ``open_engine`` (what ``from agentkv import open_engine`` gives) by the stand-in for
    the ``with`` block; its arguments are checked against the real signature. Yields the engines made."""
    real = factory.open_engine
    signature = inspect.signature(real)
    made: list[ScriptedEngine] = []

    def stand_in(*args: Any, **kwargs: Any) -> ScriptedEngine:
        signature.bind(*args, **kwargs)
        engine = ScriptedEngine([reply] * REPLIES_PER_ENGINE, exact=bool(kwargs.get("exact", False)))
        made.append(engine)
        return engine

    factory.open_engine = stand_in  # type: ignore[assignment]
    try:
        yield made
    finally:
        factory.open_engine = real
