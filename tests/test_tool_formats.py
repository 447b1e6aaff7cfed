"""Tests of agentkv.chat.tool_formats: each family's tool-call format writes, parses back and
constrains its own markup (grammars checked with llguidance over zoo vocabularies, no model run),
and detect_tool_format picks the format from the repo's real chat templates."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import ToolCall
from agentkv.chat.tool_formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    PHI4_MINI,
    JsonCallFormat,
    ToolCallFormat,
    detect_tool_format,
)
from agentkv.chat.toolcalls import format_tool_calls, tool_call_grammar, tools_instructions
from agentkv.engine.decode.constraints import ConstraintFactory, GrammarConstraint
from agentkv.tools import calculator, clock

DATA = Path(__file__).resolve().parent / "data"
TOOLS = [calculator.schema_for_prompt(), clock.schema_for_prompt()]
MISTRAL_9 = MISTRAL.with_special_ids({"[TOOL_CALLS]": 9})
"""Mistral as detect_tool_format makes it for Mistral Nemo's vocabulary ([TOOL_CALLS] is id 9)."""
FORMATS: list[ToolCallFormat] = [HERMES, LLAMA3_JSON, MISTRAL, MISTRAL_9, PHI4_MINI]
CALC = ToolCall(id="a1b2c3d4e", name="calculator", arguments={"expression": "2+2"})
CLOCK = ToolCall(id="Z9y8X7w6v", name="clock")


def zoo_factory(family: str) -> ConstraintFactory:
    directory = DATA / "zoo" / family
    config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    eos = config.get("eos_token_id")
    return ConstraintFactory.from_tokenizer_json((directory / "tokenizer.json").read_text(encoding="utf-8"),
                                                 eos_token_id=eos, vocab_size=config["vocab_size"])


@pytest.fixture(scope="module")
def factories() -> dict[str, ConstraintFactory]:
    return {"qwen2_5": zoo_factory("qwen2_5"), "mistral_nemo": zoo_factory("mistral_nemo")}


def factory_for(fmt: ToolCallFormat, factories: dict[str, ConstraintFactory]) -> ConstraintFactory:
    """Mistral's markup is Mistral Nemo's control token; the others are text in Qwen's vocabulary."""
    return factories["mistral_nemo" if fmt is MISTRAL_9 else "qwen2_5"]


def accepts(factory: ConstraintFactory, grammar: str, text: str) -> bool:
    """True if the grammar lets the model write ``text`` (its ids, token by token) and then stop."""
    constraint: GrammarConstraint = factory(grammar)
    for token in factory.tokenizer.tokenize_str(text):
        if not constraint.allowed_mask()[token]:
            return False
        constraint.advance(token)
    return constraint.is_accepting()


def calls_for(fmt: ToolCallFormat) -> list[ToolCall]:
    """Two calls, or one for Llama (its template renders one call per message)."""
    return [CALC] if fmt is LLAMA3_JSON else [CALC, CLOCK]


names = st.from_regex(r"[A-Za-z0-9_.-]{1,20}", fullmatch=True)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(min_size=1, max_size=10), json_values, max_size=4)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
@settings(max_examples=60, deadline=None)
@given(name=names, args=arguments, prose=st.sampled_from(["", "Let me check.", "Sure.\n"]))
def test_formatted_calls_parse_back_to_the_same_calls(fmt: ToolCallFormat, name: str, args: dict[str, Any],
                                                      prose: str) -> None:
    calls = [ToolCall(id="Q1w2E3r4T", name=name, arguments=args)]
    if fmt is not LLAMA3_JSON:
        calls.append(ToolCall(id="q1W2e3R4t", name=name + "x", arguments={}))
    parsed = fmt.parse(prose + ("\n" if prose else "") + fmt.format_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in calls]
    assert parsed.content == prose.strip() and parsed.errors == () and not parsed.truncated
    assert fmt.format_calls(parsed.tool_calls) == fmt.format_calls(calls)


def test_mistral_keeps_the_models_call_ids_and_derives_stable_ones_from_agentkv_ids() -> None:
    parsed = MISTRAL.parse(MISTRAL.format_calls([CALC, CLOCK]))
    assert [c.id for c in parsed.tool_calls] == ["a1b2c3d4e", "Z9y8X7w6v"]
    derived = MISTRAL.call_id("call_0123456789ab")
    assert len(derived) == 9 and derived.isalnum() and derived == MISTRAL.call_id("call_0123456789ab")
    assert derived != MISTRAL.call_id("call_0123456789ac")
    assert HERMES.call_id("call_0123456789ab") == "call_0123456789ab"


def test_the_formats_write_each_familys_markup() -> None:
    assert LLAMA3_JSON.format_calls([CALC]) == '{"name": "calculator", "parameters": {"expression": "2+2"}}'
    assert MISTRAL.format_calls([CALC, CLOCK]) == (
        '[TOOL_CALLS][{"name": "calculator", "arguments": {"expression": "2+2"}, "id": "a1b2c3d4e"}, '
        '{"name": "clock", "arguments": {}, "id": "Z9y8X7w6v"}]'
    )
    assert PHI4_MINI.format_calls([CLOCK]) == '<|tool_call|>[{"name": "clock", "arguments": {}}]<|/tool_call|>'
    assert HERMES.format_calls([CALC, CLOCK]) == format_tool_calls([CALC, CLOCK])


def test_hermes_is_the_toolcalls_module_unchanged() -> None:
    assert HERMES.grammar(TOOLS, "auto", parallel=False) == tool_call_grammar(TOOLS, "auto", parallel=False)
    assert HERMES.instructions(TOOLS) == tools_instructions(TOOLS)
    assert HERMES.open_tag == "<tool_call>"


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
@pytest.mark.parametrize("choice", ["required", "auto"])
def test_the_grammar_accepts_the_formatted_calls(fmt: ToolCallFormat, choice: str, factories) -> None:
    factory = factory_for(fmt, factories)
    assert accepts(factory, fmt.grammar(TOOLS, choice), fmt.format_calls(calls_for(fmt)))
    assert accepts(factory, fmt.grammar(TOOLS, choice), fmt.format_calls([CLOCK]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
def test_a_named_tool_choice_rejects_calls_of_other_tools(fmt: ToolCallFormat, factories) -> None:
    factory = factory_for(fmt, factories)
    assert accepts(factory, fmt.grammar(TOOLS, "clock"), fmt.format_calls([CLOCK]))
    assert not accepts(factory, fmt.grammar(TOOLS, "clock"), fmt.format_calls([CALC]))


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
def test_auto_accepts_plain_text_and_required_does_not(fmt: ToolCallFormat, factories) -> None:
    factory = factory_for(fmt, factories)
    assert accepts(factory, fmt.grammar(TOOLS, "auto"), "It is 4.")
    assert not accepts(factory, fmt.grammar(TOOLS, "required"), "It is 4.")


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL, PHI4_MINI], ids=lambda f: f.name)
def test_without_parallel_calls_the_grammar_allows_one_call(fmt: JsonCallFormat, factories) -> None:
    factory = factories["qwen2_5"]
    assert not accepts(factory, fmt.grammar(TOOLS, "required", parallel=False), fmt.format_calls([CALC, CLOCK]))
    assert accepts(factory, fmt.grammar(TOOLS, "required", parallel=False), fmt.format_calls([CALC]))


def test_llama_never_gets_two_calls_in_one_answer(factories) -> None:
    two_calls = LLAMA3_JSON.format_calls([CALC, CLOCK])
    assert not accepts(factories["qwen2_5"], LLAMA3_JSON.grammar(TOOLS, "required"), two_calls)


def test_mistrals_grammar_forces_its_control_token_not_the_spelled_text(factories) -> None:
    factory = factories["mistral_nemo"]
    constraint = factory(MISTRAL_9.grammar(TOOLS, "auto"))
    assert constraint.allowed_mask()[9]
    spelled = factory.tokenizer.tokenize_str("[TOOL")
    assert 9 not in spelled and not accepts(factory, MISTRAL_9.grammar(TOOLS, "required"), "[TOOL")


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
@settings(max_examples=80, deadline=None)
@given(text=st.text(max_size=60)
       | st.sampled_from(['{"name": ', "[TOOL_CALLS][{", "<|tool_call|>[1]", "<tool_call>\n{"]))
def test_parsing_never_raises_and_reports_errors_as_text(fmt: ToolCallFormat, text: str) -> None:
    parsed = fmt.parse(text)
    assert all(isinstance(error, str) and error for error in parsed.errors)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f"{f.name}{getattr(f, 'special_ids', '')}")
def test_a_call_cut_by_the_token_limit_is_truncated_with_an_error_for_the_model(fmt: ToolCallFormat) -> None:
    text = fmt.format_calls(calls_for(fmt))
    parsed = fmt.parse(text[: len(text) - 4])
    assert parsed.truncated and parsed.errors and "write exactly" in parsed.errors[-1]


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL, PHI4_MINI], ids=lambda f: f.name)
def test_a_malformed_call_is_an_error_text_naming_the_fix(fmt: JsonCallFormat) -> None:
    bad = fmt.format_calls([CALC]).replace('"name"', '"nom"')
    if fmt is LLAMA3_JSON:
        bad = '{"name": 5, "parameters": {}}'
    parsed = fmt.parse(bad)
    assert parsed.tool_calls == () and not parsed.truncated
    assert len(parsed.errors) == 1 and '"name" is missing' in parsed.errors[0] and "write exactly" in parsed.errors[0]


def test_llamas_python_tag_is_markup_not_content() -> None:
    parsed = LLAMA3_JSON.parse("<|python_tag|>" + LLAMA3_JSON.format_calls([CALC]))
    assert parsed.content == "" and parsed.tool_calls[0].name == "calculator"


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL, PHI4_MINI], ids=lambda f: f.name)
def test_instructions_list_the_tools_and_show_the_formats_markup(fmt: JsonCallFormat) -> None:
    text = fmt.instructions(TOOLS)
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text
    assert fmt.format_calls([ToolCall(name="<tool name>", arguments={"<argument>": "<value>"})]).startswith(
        fmt.open_tag if fmt is not LLAMA3_JSON else '{"name": ')
    assert ('"parameters"' if fmt is LLAMA3_JSON else fmt.open_tag) in text


TEMPLATES = {
    "qwen2_5": "hermes", "qwen3": "hermes", "llama3_1": "llama3_json", "llama3_2": "llama3_json",
    "mistral_nemo": "mistral", "phi3_5": "hermes", "gemma2": "hermes", "gemma3": "hermes",
}


@pytest.mark.parametrize("family", sorted(TEMPLATES))
def test_detect_tool_format_picks_each_templates_format(family: str) -> None:
    template = (DATA / "templates" / f"{family}.jinja").read_text(encoding="utf-8")
    vocabulary = {"<s>": 1, "</s>": 2, "[TOOL_CALLS]": 9} if family == "mistral_nemo" else {"<|im_end|>": 2}
    found = detect_tool_format(template, vocabulary)
    assert found.name == TEMPLATES[family]
    if family == "mistral_nemo":
        assert isinstance(found, JsonCallFormat) and found.special_ids == (("[TOOL_CALLS]", 9),)


def test_detect_tool_format_finds_phi4_minis_token_and_falls_back_to_hermes() -> None:
    found = detect_tool_format("{{ messages }}", ["<pad>", "<|tool_call|>", "<|/tool_call|>"])
    assert found == PHI4_MINI.with_special_ids({"<|tool_call|>": 1, "<|/tool_call|>": 2})
    assert detect_tool_format("{{ messages }}", set()) is HERMES
    assert detect_tool_format("{{ messages }}", {"[TOOL_CALLS]"}) is HERMES  # the token alone is not enough


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL, PHI4_MINI], ids=lambda f: f.name)
async def test_the_agent_loop_uses_the_renderers_format_for_grammar_parse_and_hidden_markup(fmt: JsonCallFormat):
    from agentkv import Agent, Runtime, tool
    from agentkv.events import TextDelta, ToolCalled
    from agentkv.testing import ScriptedEngine

    @tool
    def add(a: int, b: int) -> int:
        """Add two integers."""
        return a + b

    written = fmt.format_calls([ToolCall(id="a1b2c3d4e", name="add", arguments={"a": 2, "b": 3})])
    engine = ScriptedEngine(["Adding. " + written, "The sum is 5."])
    runtime = Runtime(engine)
    agent = Agent(name="math", tools=[add])
    conversation = await runtime.open_conversation(agent)
    conversation.renderer.tool_format = fmt  # type: ignore[attr-defined]  # set by ChatRenderer once it detects formats
    events = [e async for e in runtime.run_stream(conversation, "2+3?")]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Adding. The sum is 5."
    called = [e for e in events if isinstance(e, ToolCalled)]
    assert [(e.call.name, e.call.arguments) for e in called] == [("add", {"a": 2, "b": 3})]
    assert engine.requested_grammars[0] == fmt.grammar(agent.tool_schemas, agent.tool_choice,
                                                       parallel=agent.parallel_tool_calls)
    tool_message = conversation.messages[2]
    assert tool_message.role == "tool" and tool_message.content == "5"
    if fmt is MISTRAL:
        assert tool_message.tool_call_id == "a1b2c3d4e"
    engine.assert_complete()


def test_two_different_mistral_calls_the_model_gave_one_id_get_ids_of_their_own() -> None:
    parsed = MISTRAL.parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}, "id": "abcdefghi"}, '
                           '{"name": "a", "arguments": {"x": 2}, "id": "abcdefghi"}]')
    assert [c.arguments for c in parsed.tool_calls] == [{"x": 1}, {"x": 2}]
    assert parsed.tool_calls[0].id == "abcdefghi" and len({c.id for c in parsed.tool_calls}) == 2
