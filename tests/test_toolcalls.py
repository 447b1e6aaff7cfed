"""Tests of agentkv.chat.toolcalls: the <tool_call> text format, its parser, bounded schemas, grammars."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import ToolCall
from agentkv.chat.stream_filter import MarkupFilter
from agentkv.chat.toolcalls import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    format_tool_calls,
    parse_tool_calls,
    partial_open_tag,
    tool_call_grammar,
)
from agentkv.chat.grammar_schema import MAX_KEY_LENGTH, bounded_schema
from agentkv.engine.decode.constraints import ConstraintFactory
from agentkv.engine.openvino.models import resolve_model
from agentkv.tools import calculator, clock

TOOLS = [calculator.schema_for_prompt(), clock.schema_for_prompt()]


@pytest.fixture(scope="module")
def factory() -> ConstraintFactory:
    meta = resolve_model(None).gguf_metadata()
    return ConstraintFactory(
        meta["tokenizer.ggml.tokens"],
        eos_token_id=2,
        vocab_size=49152,
        token_types=meta["tokenizer.ggml.token_type"],
    )


def test_format_writes_one_block_per_call_in_json_dumps_layout():
    calls = [ToolCall(name="calculator", arguments={"expression": "2+2"}), ToolCall(name="clock")]
    assert format_tool_calls(calls) == (
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+2"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
    )


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=10,
)
tool_calls = st.builds(
    ToolCall,
    name=st.from_regex(r"[A-Za-z0-9_-]{1,20}", fullmatch=True),
    arguments=st.dictionaries(st.text(max_size=8), json_values, max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(tool_calls, max_size=3), st.text(st.characters(blacklist_characters="<"), max_size=30))
def test_parse_of_formatted_calls_gives_back_their_names_and_arguments(calls, prose):
    parsed = parse_tool_calls(prose + "\n" + format_tool_calls(calls))
    def key(call: ToolCall) -> str:
        return json.dumps([call.name, call.arguments], sort_keys=True)

    distinct = [(c.name, c.arguments) for i, c in enumerate(calls)
                if all(key(c) != key(e) for e in calls[:i])]
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == distinct  # repeats dropped
    assert parsed.repeats == len(calls) - len(distinct) and parsed.errors == ()
    assert parsed.content == prose.strip()


def test_parse_of_plain_text_has_no_calls_and_keeps_the_text_stripped():
    assert parse_tool_calls("  The answer is 4.\n") == parse_tool_calls("The answer is 4.")
    parsed = parse_tool_calls("  The answer is 4.\n")
    assert (parsed.content, parsed.tool_calls, parsed.errors) == ("The answer is 4.", (), ())


def test_parse_of_two_blocks_keeps_the_prose_around_them_as_content():
    text = (
        'Let me check.\n<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>\nand\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/3"}}\n</tool_call>\nDone.'
    )
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.tool_calls] == ["clock", "calculator"]
    assert parsed.tool_calls[1].arguments == {"expression": "1/3"}
    assert parsed.content == "Let me check.\nand\nDone."
    assert parsed.tool_calls[0].id != parsed.tool_calls[1].id


def test_block_with_bad_json_becomes_an_error_text_and_the_good_block_still_parses():
    text = (
        '<tool_call>\n{"name": "clock", "arguments": {\n</tool_call>\n'
        '<tool_call>\n{"name": "clock", "arguments": {}}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert [c.name for c in parsed.tool_calls] == ["clock"]
    assert len(parsed.errors) == 1
    assert parsed.errors[0].startswith("tool call 1: invalid JSON")
    assert TOOL_CALL_OPEN in parsed.errors[0] and TOOL_CALL_CLOSE in parsed.errors[0]


@pytest.mark.parametrize(
    ("body", "complaint"),
    [
        ('{"arguments": {}}', '"name" is missing'),
        ('{"name": "", "arguments": {}}', '"name" is missing'),
        ('["clock"]', "expected a JSON object"),
        ('{"name": "clock", "arguments": [1]}', "must be a JSON object"),
        ('{"name": "clock", "arguments": "not json"}', "string that is not JSON"),
    ],
)
def test_malformed_block_is_reported_not_raised(body, complaint):
    parsed = parse_tool_calls(f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}")
    assert parsed.tool_calls == ()
    assert len(parsed.errors) == 1 and complaint in parsed.errors[0]


def test_missing_arguments_mean_none_and_string_arguments_are_decoded():
    parsed = parse_tool_calls(
        '<tool_call>{"name": "clock"}</tool_call><tool_call>{"name": "calculator", '
        '"arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
    )
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("clock", {}),
        ("calculator", {"expression": "1+1"}),
    ]


def test_missing_close_tag_at_the_end_of_text_is_tolerated():
    parsed = parse_tool_calls('Sure.\n<tool_call>\n{"name": "clock", "arguments": {"timezone": "UTC"}}\n')
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [("clock", {"timezone": "UTC"})]
    assert parsed.content == "Sure."
    assert parsed.errors == ()


def test_missing_close_tag_before_the_next_open_tag_ends_the_block_there():
    block, other = '{"name": "clock", "arguments": {}}', '{"name": "clock", "arguments": {"timezone": "UTC"}}'
    parsed = parse_tool_calls(f"<tool_call>{block}\n<tool_call>{other}</tool_call>")
    assert len(parsed.tool_calls) == 2 and parsed.errors == ()


def test_close_tag_inside_a_json_string_does_not_end_the_block():
    call = ToolCall(name="calculator", arguments={"expression": "1}}</tool_call> <tool_call>"})
    parsed = parse_tool_calls(format_tool_calls([call]) + "\nafter")
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(call.name, call.arguments)]
    assert parsed.content == "after" and parsed.errors == ()


def test_text_after_the_json_inside_a_block_is_an_error():
    parsed = parse_tool_calls('<tool_call>{"name": "clock", "arguments": {}} and more</tool_call>')
    assert parsed.tool_calls == () and "Extra data" in parsed.errors[0]


def test_truncated_block_at_the_end_of_text_is_an_error():
    parsed = parse_tool_calls('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2')
    assert parsed.tool_calls == () and len(parsed.errors) == 1


BLOCK_F = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


@pytest.mark.parametrize("cut", ["<", "<tool", "<tool_call"])
def test_an_opening_tag_cut_after_a_complete_call_is_a_truncated_call_not_content(cut):
    parsed = parse_tool_calls(f"{BLOCK_F}\n{cut}")
    assert parsed.content == "" and parsed.truncated
    assert [c.arguments for c in parsed.tool_calls] == [{"a": 1}] and "cut off" in parsed.errors[0]


@pytest.mark.parametrize("text", ["<", "<tool_c", "Let me check.\n<tool", "Sure.\n  <"])
def test_an_opening_tag_cut_at_a_line_start_never_reaches_the_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.truncated and "<" not in parsed.content


@pytest.mark.parametrize("text", ["if x <", "a <t", "3 < 4"])
def test_a_less_than_sign_inside_a_line_of_prose_stays_content(text):
    parsed = parse_tool_calls(text)
    assert parsed.content == text and not parsed.truncated and parsed.errors == ()
    assert partial_open_tag(text) == 0


def test_a_block_cut_in_its_json_after_a_complete_call_is_truncated():
    parsed = parse_tool_calls(BLOCK_F + '\n<tool_call>\n{"name": "f", "argu')
    assert parsed.truncated and len(parsed.tool_calls) == 1 and parsed.content == ""


def test_a_closed_malformed_block_is_invalid_not_truncated():
    parsed = parse_tool_calls('<tool_call>\n{"name": 1}\n</tool_call>')
    assert not parsed.truncated and len(parsed.errors) == 1


def test_identical_calls_in_one_output_are_kept_once_in_order():
    calls = [ToolCall(name="f", arguments={"a": 1, "b": 2}), ToolCall(name="f", arguments={"a": 1, "b": 2}),
             ToolCall(name="g", arguments={"a": 1, "b": 2}), ToolCall(name="f", arguments={"b": 2, "a": 1}),
             ToolCall(name="f", arguments={"a": 2, "b": 2})]
    parsed = parse_tool_calls(format_tool_calls(calls))
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [
        ("f", {"a": 1, "b": 2}), ("g", {"a": 1, "b": 2}), ("f", {"a": 2, "b": 2})]
    assert parsed.repeats == 2 and parsed.errors == () and not parsed.truncated


def test_bounded_schema_closes_objects_with_declared_properties_at_every_depth():
    schema = {"type": "object", "properties": {
        "start": {"type": "string"},
        "options": {"type": "object", "properties": {"unit": {"enum": ["km", "mi"]}}},
        "stops": {"type": "array", "items": {"properties": {"city": {"type": "string"}}}},
        "open": {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
    }}
    bounded = bounded_schema(schema)
    props = bounded["properties"]
    assert bounded["additionalProperties"] is False
    assert props["options"]["additionalProperties"] is False
    assert props["stops"]["items"]["additionalProperties"] is False
    assert props["open"]["additionalProperties"] != True  # noqa: E712 (allowed by the schema, but bounded)
    assert props["open"]["additionalProperties"]["anyOf"][0]["maxLength"] == 200


def test_bounded_schema_bounds_the_keys_and_values_of_free_form_maps():
    bounded = bounded_schema({"type": "object", "properties": {
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "meta": {"type": "object"},
        "anything": {"description": "any value"},
    }}, max_items=5)
    tags, meta = bounded["properties"]["tags"], bounded["properties"]["meta"]
    for free in (tags, meta):
        assert free["additionalProperties"] is False and free["maxProperties"] == 5
        [(pattern, value)] = free["patternProperties"].items()
        assert pattern == f"^.{{1,{MAX_KEY_LENGTH}}}$"
    assert tags["patternProperties"][f"^.{{1,{MAX_KEY_LENGTH}}}$"] == {"type": "string", "maxLength": 200}
    assert {"type": "string", "maxLength": 200} in bounded["properties"]["anything"]["anyOf"]


def test_bounded_schema_bounds_every_string_and_array_and_keeps_existing_bounds():
    schema = {
        "type": "object",
        "properties": {
            "type": {"type": "string"},
            "short": {"type": "string", "maxLength": 5},
            "tags": {"type": "array", "items": {"type": "string"}},
            "many": {"type": "array", "minItems": 40},
            "either": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            "nullable": {"type": ["string", "null"]},
            "choice": {"type": "string", "enum": ["a", "b"]},
            "ref": {"$ref": "#/$defs/Inner"},
        },
        "$defs": {"Inner": {"type": "object", "properties": {"note": {"type": "string"}}}},
        "default": {"type": "string"},
    }
    original = json.loads(json.dumps(schema))
    bounded = bounded_schema(schema, max_string_length=50, max_items=8)
    props = bounded["properties"]
    assert props["type"]["maxLength"] == 50
    assert props["short"]["maxLength"] == 5
    assert props["tags"]["maxItems"] == 8 and props["tags"]["items"]["maxLength"] == 50
    assert props["many"]["maxItems"] == 40  # never below minItems
    assert props["either"]["anyOf"][0]["maxLength"] == 50
    assert props["nullable"]["maxLength"] == 50
    assert "maxLength" not in props["choice"]
    assert bounded["$defs"]["Inner"]["properties"]["note"]["maxLength"] == 50
    assert bounded["default"] == {"type": "string"}  # data, not a schema
    assert schema == original  # the input is not modified


def test_bounded_schema_refuses_zero_bounds():
    with pytest.raises(ValueError):
        bounded_schema({"type": "string"}, max_string_length=0)


@pytest.mark.parametrize("tool_choice", ["required", "auto", "calculator", "clock"])
def test_grammar_for_each_tool_choice_builds_through_the_constraint_factory(factory, tool_choice):
    grammar = tool_call_grammar(TOOLS, tool_choice)
    constraint = factory(grammar)
    mask = constraint.allowed_mask()
    assert mask.shape == (49152,) and mask.any()
    assert '"x-guidance"' in grammar and '"maxLength": 200' in grammar


def test_named_tool_choice_offers_only_that_tool():
    grammar = tool_call_grammar(TOOLS, "clock")
    assert '\\"clock\\"' in grammar and '\\"calculator\\"' not in grammar


@pytest.mark.parametrize(
    ("tools", "tool_choice", "message"),
    [
        (TOOLS, "none", "needs no grammar"),
        (TOOLS, "weather", "tool_choice must be"),
        ([], "required", "at least one tool"),
        ([TOOLS[0], TOOLS[0]], "required", "unique"),
        ([{"type": "function", "function": {"name": "bad name"}}], "required", "not allowed"),
        ([{"type": "function"}], "required", "each tool must look like"),
    ],
)
def test_grammar_refuses_what_it_cannot_express(tools, tool_choice, message):
    with pytest.raises(ValueError, match=message):
        tool_call_grammar(tools, tool_choice)


@pytest.mark.parametrize(("chunks", "shown"), [
    (["Sure.\n<to"], "Sure.\n"),           # a tag cut at a line start: held back, then dropped
    (["<"], ""),
    (["a", "\n", "<tool_c"], "a\n"),
    (["if x <"], "if x <"),               # a "<" inside prose is shown at the end
    (["Sure. <tool", "_call>\n{}"], "Sure. "),
])
def test_the_stream_filter_never_shows_markup_nor_a_tag_cut_at_a_line_start(chunks, shown):
    markup = MarkupFilter(TOOL_CALL_OPEN)
    assert "".join(markup.feed(chunk) for chunk in chunks) + markup.flush() == shown


def test_bounded_schema_leaves_the_members_of_an_all_of_open_to_each_others_keys():
    schema = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                          {"properties": {"b": {"type": "object", "properties": {}}}}]}
    bounded = bounded_schema(schema)
    assert all("additionalProperties" not in member for member in bounded["allOf"])
    assert "additionalProperties" not in bounded
    assert bounded["allOf"][1]["properties"]["b"]["additionalProperties"] is False  # deeper objects close
