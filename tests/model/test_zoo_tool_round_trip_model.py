"""A tool round trip on every zoo family renders with the family's own template, and the next turn reuses its KV.

Per family of tests/data/zoo (the shared exact engine, ``zoo_helpers.exact_zoo_engine``), an agent
with one ``@tool`` and ``tool_choice="required"`` runs two turns: the first calls the tool, reads
its result and answers; the second, a new user turn, does it again. Throughout, nothing in
``agentkv.chat`` logs a warning (the renderer's ChatML fallback is a failure here, not a warning:
the model never saw ChatML), and the KV behaves as the family's template allows:

- Qwen2.5, Qwen3, Llama 3.1, Phi-3.5, Gemma 2, Gemma 3: the next turn reuses all the KV the
  conversation held and prefills only the new turn; no model call of either turn breaks the cache.
- Mistral Nemo: its template writes the tool schemas (``[AVAILABLE_TOOLS]``) before the *last*
  user turn and the system prompt inside it (left out while a tool result is last), so a new user
  turn re-reads everything after ``<s>``, and each call after a tool result re-reads from where
  the system prompt was. Never from token 0, and never in ChatML: before issue 45 the history
  after a call's answer fell back to ChatML (the template's role-alternation check skips calling
  messages, which the renderer showed it as text).
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import pytest
from zoo_helpers import FAMILIES, exact_zoo_engine

from agentkv import Agent, GenerationConfig, Runtime, tool

pytestmark = pytest.mark.model

MOVES_THE_TOOLS = {"mistral_nemo"}
"""Templates that write the tool schemas before the last user turn (a new turn re-reads them)."""
CHATML_FAMILIES = {"qwen2_5", "qwen3"}
"""Families whose own template is ChatML."""


@tool
def forecast(city: Literal["Paris", "Rome"]) -> str:
    """The weather in a city.

    Args:
        city: The city.
    """
    return f"sunny in {city}"


AGENT = Agent(name="weather-desk", instructions="You are a terse assistant for a weather desk.", tools=[forecast],
              tool_choice="required", max_model_calls=3, parallel_tool_calls=False,
              generation=GenerationConfig(max_new_tokens=40))


def test_every_family_of_the_zoo_is_checked() -> None:
    assert set(FAMILIES) >= {"qwen2_5", "qwen3", "llama3_1", "phi3_5", "gemma2", "gemma3", "mistral_nemo"}


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_tool_round_trip_renders_with_the_familys_template_and_the_next_turn_reuses_its_kv(
        family: str, caplog: pytest.LogCaptureFixture) -> None:
    engine = exact_zoo_engine(family)
    runtime = Runtime(engine)
    try:
        with caplog.at_level(logging.WARNING, logger="agentkv"):
            conversation = await runtime.open_conversation(AGENT)
            first = await runtime.run(conversation, "What is the weather in Paris?")
            held = tuple(conversation.kv.tokens)
            second = await runtime.run(conversation, "Thanks. And in Rome?")
            read = tuple(conversation.kv.tokens[: second.call_metrics[0].prompt_tokens])
    finally:
        await runtime.aclose()
    warnings = [r.getMessage() for r in caplog.records if r.name.startswith("agentkv.chat")]
    assert warnings == [], f"{family}: the renderer left the family's template: {warnings}"
    assert conversation.renderer.uses_template
    for result in (first, second):
        assert [m.role for m in result.new_messages] == ["user", "assistant", "tool", "assistant"]
        assert [c.name for c in result.tool_calls] == ["forecast"] and result.final_text is not None
    text = engine.tokenizer.decode(list(read))
    assert ("<|im_start|>" in text) == (family in CHATML_FAMILIES), text[:200]

    metrics = second.call_metrics[0]
    assert metrics.reused_tokens > 0 and metrics.prefilled_tokens == metrics.prompt_tokens - metrics.reused_tokens
    breaks: list[Any] = [*first.cache_breaks, *second.cache_breaks]
    assert all(found is None or found.position > 0 for found in breaks), breaks
    if family not in MOVES_THE_TOOLS:
        assert metrics.reused_tokens == len(held)  # all the KV it held: the prompt and the answer
        assert all(found is None for found in breaks), breaks
        return
    # Mistral Nemo: the next turn re-reads from the tool schemas the template moved after the history
    assert engine.tokenizer.decode(list(held[metrics.reused_tokens:])).startswith("[AVAILABLE_TOOLS]")
    assert read[metrics.reused_tokens:] != held[metrics.reused_tokens:]
    later = [found for result in (first, second) for found in result.cache_breaks[1:]]
    assert all(found is None or found.role == "user" for found in later), later  # where the system prompt was
