"""Each zoo family's detected tool-call format writes exactly what the family's own chat template
renders for an assistant message's tool calls (the OpenVINO tokenizer's jinja: ``tojson`` keeps
key order, writes ``", "`` / ``": "`` and non-ASCII as is, escapes no HTML, i.e.
``json.dumps(..., ensure_ascii=False)``, the grammar's JSON layout), and the text the model writes
tokenises to the ids the template's rendering holds. Only tokenizers are loaded (cheap)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import openvino_genai
import pytest
from zoo_helpers import exact_zoo_engine

from agentkv import Agent, GenerationConfig, Runtime, tool
from agentkv.chat.messages import ToolCall
from agentkv.chat.tool_formats import JsonCallFormat, ToolCallFormat, detect_tool_format
from agentkv.tools import calculator

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
EXPECTED = {"qwen2_5": "hermes", "qwen3": "hermes", "llama3_1": "llama3_json", "mistral_nemo": "mistral"}
ARGUMENTS: dict[str, Any] = {"expression": "2+2", "note": "x<y> & 'é' \"q\"", "n": [1, 2.5, None, True],
                             "nested": {"b": 1, "a": "z"}}
"""Key order not sorted, HTML characters, non-ASCII, quotes, floats, null and booleans."""


def vocabulary(family: str) -> dict[str, int]:
    data = json.loads((ZOO / family / "tokenizer.json").read_text(encoding="utf-8"))
    found = dict(data["model"]["vocab"])
    found.update({token["content"]: token["id"] for token in data.get("added_tokens", [])})
    return found


def calls_for(family: str) -> list[ToolCall]:
    calls = [ToolCall(id="a1b2c3d4e", name="calculator", arguments=ARGUMENTS)]
    if family != "llama3_1":  # Llama 3.1's template raises on more than one call per message
        calls.append(ToolCall(id="Z9y8X7w6v", name="clock", arguments={}))
    return calls


def rendered(tokenizer: openvino_genai.Tokenizer, fmt: ToolCallFormat, calls: list[ToolCall]) -> str:
    """A conversation ending in an assistant message with ``calls``, as the template renders it
    (whole: Mistral Nemo's template moves the system text into the last user turn, so a shorter
    conversation's rendering is no prefix of it)."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assistant = {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": fmt.call_id(c.id), "type": "function",
                        "function": {"name": c.name, "arguments": c.arguments}} for c in calls],
    }
    tools = [calculator.schema_for_prompt()]
    return str(tokenizer.apply_chat_template([*messages, assistant], add_generation_prompt=False, tools=tools))


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_format_calls_is_what_the_familys_template_renders(family: str) -> None:
    tokenizer = openvino_genai.Tokenizer(str(ZOO / family))
    fmt = detect_tool_format(tokenizer.chat_template, vocabulary(family))
    assert fmt.name == EXPECTED[family]
    calls = calls_for(family)
    after = rendered(tokenizer, fmt, calls)
    written = fmt.format_calls(calls)
    assert written in after
    # what follows the calls is the template's end of turn, not more call text
    tail = after[after.rindex(written) + len(written):]
    assert tail in ("<|im_end|>\n", "<|eot_id|>", "</s>")
    parsed = fmt.parse(written)
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.errors == ()


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_the_written_calls_tokenise_to_the_ids_the_template_renders(family: str) -> None:
    """The KV of what the model wrote equals the template's next-turn rendering: the ids of the
    written text are the ids the rendered conversation holds at that place."""
    tokenizer = openvino_genai.Tokenizer(str(ZOO / family))
    fmt = detect_tool_format(tokenizer.chat_template, vocabulary(family))
    calls = calls_for(family)
    after = rendered(tokenizer, fmt, calls)
    written = fmt.format_calls(calls)
    start = after.rindex(written)

    def ids(text: str) -> list[int]:
        return [int(i) for i in tokenizer.encode(text, add_special_tokens=False).input_ids.data[0]]

    prefix_ids, written_ids = ids(after[:start]), ids(written)
    assert ids(after[: start + len(written)]) == prefix_ids + written_ids
    if isinstance(fmt, JsonCallFormat) and fmt.special_ids:
        assert written_ids[0] == dict(fmt.special_ids)[fmt.open_tag]


@tool
def forecast(city: Literal["Paris", "Rome"], tomorrow: bool) -> str:
    """The weather in a city.

    Args:
        city: The city.
        tomorrow: Tomorrow's weather rather than today's.
    """
    return f"sunny in {city}"


FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "reference.json").is_file())
MOVES_THE_SYSTEM_PROMPT = {"mistral_nemo"}
"""Templates whose user turns change as the conversation goes on (the renderer's business)."""


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tool_choice", ["required", "auto"])
async def test_every_zoo_model_answers_in_its_native_call_format_and_the_kv_holds(family: str, tool_choice: str
                                                                                   ) -> None:
    """On the real engine (random weights: the structure comes from the grammar) the model writes
    the family's own markup under the format the renderer detected (Mistral: the [TOOL_CALLS]
    control token, then a 9-character id the tool result carries) or, under ``auto``, may answer
    in text; a call parses, the tool runs, and no later call breaks the KV."""
    engine = exact_zoo_engine(family, num_slots=1)  # opened once per family (test_own_model_tools too)
    agent = Agent(name="weather", tools=[forecast], tool_choice=tool_choice, max_model_calls=3,
                  parallel_tool_calls=False, generation=GenerationConfig(max_new_tokens=80))
    runtime = Runtime(engine)
    try:
        conversation = await runtime.open_conversation(agent)
        fmt = conversation.renderer.tool_format
        result = await runtime.run(conversation, "What is the weather in Paris?")
    finally:
        await runtime.aclose()
    assert fmt.name == EXPECTED.get(family, "hermes")
    later = result.cache_breaks[1:]
    if family not in MOVES_THE_SYSTEM_PROMPT:
        assert all(found is None for found in later), later
    else:  # the call's own tokens are never where the KV breaks
        assert all(found is None or found.role != "assistant" for found in later), later
    calling = [m for m in result.new_messages if m.role == "assistant" and m.tool_calls]
    if tool_choice == "auto" and not calling:
        assert result.final_text and not result.tool_calls  # it answered in text, which parsed as text
        return
    assistant = calling[0]
    assert assistant.token_ids is not None
    written = engine.tokenizer.decode(assistant.token_ids)
    parsed = [(c.name, c.arguments) for c in fmt.parse(written).tool_calls]
    assert written.startswith(fmt.open_tag) and parsed == [(c.name, c.arguments) for c in assistant.tool_calls]
    if isinstance(fmt, JsonCallFormat) and fmt.special_ids:
        assert assistant.token_ids[0] == dict(fmt.special_ids)[fmt.open_tag]
    [call] = result.tool_calls
    assert call.name == "forecast" and set(call.arguments) == {"city", "tomorrow"}
    tool_results = [m for m in result.new_messages if m.role == "tool"]
    assert [m.content for m in tool_results] == [f"sunny in {call.arguments['city']}"]
    if fmt.name == "mistral":
        assert tool_results[0].tool_call_id == call.id and len(call.id) == 9 and call.id.isalnum()
