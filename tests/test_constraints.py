"""Tests of agentkv.engine.decode.constraints: llguidance masks from the GGUF vocabulary, and
grammar-constrained tool calls on the real model (marked ``model``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import (
    format_tool_calls,
    tool_call_grammar,
)
from agentkv.engine.decode.constraints import (
    ConstraintFactory,
    GrammarConstraint,
    llg_tokenizer_from_gguf_vocab,
)
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.tokenizer import OVTokenizer
from agentkv.errors import ConstraintError
from agentkv.tools import calculator, clock

EOS = 2
VOCAB = 49152
TOOLS = [calculator.schema_for_prompt(), clock.schema_for_prompt()]


@pytest.fixture(scope="module")
def vocab() -> dict:
    return resolve_model(None).gguf_metadata()


@pytest.fixture(scope="module")
def tokenizer() -> OVTokenizer:
    return OVTokenizer(resolve_model(None).ir_dir)


@pytest.fixture(scope="module")
def factory(vocab, tokenizer) -> ConstraintFactory:
    return ConstraintFactory(
        vocab["tokenizer.ggml.tokens"],
        eos_token_id=EOS,
        vocab_size=VOCAB,
        token_types=vocab["tokenizer.ggml.token_type"],
        encode=tokenizer.encode,
    )


def walk(constraint: GrammarConstraint, ids: Sequence[int]) -> bool:
    """Feed ``ids`` while the mask allows them; True if all were allowed. Checks at every step
    that EOS is allowed exactly when the grammar accepts."""
    for token in ids:
        mask = constraint.allowed_mask()
        assert mask[EOS] == constraint.is_accepting()
        if not mask[token]:
            return False
        constraint.advance(token)
    return True


def test_gpt2_byte_tokens_decode_to_their_bytes_and_specials_stay_special(vocab):
    tokens = vocab["tokenizer.ggml.tokens"]
    llt = llg_tokenizer_from_gguf_vocab(
        tokens, eos_token_id=EOS, vocab_size=VOCAB, token_types=vocab["tokenizer.ggml.token_type"]
    )
    the = tokens.index("Ġthe")
    newline = tokens.index("Ċ")
    assert llt.decode_bytes([the, newline]) == b" the\n"
    assert llt.vocab_size == VOCAB and llt.eos_token == EOS
    assert llt.is_special_token(EOS) and llt.is_special_token(tokens.index("<|im_start|>"))
    assert not llt.is_special_token(the)


def test_without_token_types_the_im_tokens_are_still_special(vocab):
    llt = llg_tokenizer_from_gguf_vocab(vocab["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=VOCAB)
    assert llt.is_special_token(1) and llt.is_special_token(EOS)


def test_vocabulary_wider_than_vocab_size_is_refused(vocab):
    with pytest.raises(ConstraintError, match="vocab_size"):
        llg_tokenizer_from_gguf_vocab(vocab["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=100)


def test_logits_wider_than_the_vocabulary_never_allow_the_padding_ids(vocab):
    factory = ConstraintFactory(vocab["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=VOCAB + 64)
    mask = factory("start: /[a-z ]+/").allowed_mask()
    assert mask.shape == (VOCAB + 64,) and mask.dtype == np.bool_
    assert not mask[VOCAB:].any() and mask[:VOCAB].any()


def test_formatted_call_walks_through_the_required_grammar_and_then_only_eos_remains(factory, tokenizer):
    text = format_tool_calls([ToolCall(name="calculator", arguments={"expression": "2 * (3 + 4)"})])
    constraint = factory(tool_call_grammar(TOOLS, "required", parallel=False))
    assert walk(constraint, tokenizer.encode(text))
    assert constraint.is_finished()
    mask = constraint.allowed_mask()
    assert mask[EOS] and mask.sum() == 1
    constraint.advance(EOS)


def test_parallel_calls_walk_through_the_grammar_and_only_one_call_does_without_parallel(factory, tokenizer):
    two = format_tool_calls([ToolCall(name="clock", arguments={"timezone": "Europe/Paris"}),
                             ToolCall(name="calculator", arguments={"expression": "1 + 1"})])
    for choice in ("required", "auto"):
        assert walk(factory(tool_call_grammar(TOOLS, choice)), tokenizer.encode(two) + [EOS]), choice
        assert not walk(factory(tool_call_grammar(TOOLS, choice, parallel=False)), tokenizer.encode(two)), choice
    one = format_tool_calls([ToolCall(name="clock", arguments={"timezone": "Europe/Paris"})])
    assert walk(factory(tool_call_grammar(TOOLS, "required", parallel=False)), tokenizer.encode(one) + [EOS])
    three = format_tool_calls([ToolCall(name="clock", arguments={"timezone": "UTC"})] * 3)
    capped = factory(tool_call_grammar(TOOLS, "required", max_calls=2))
    assert not walk(capped, tokenizer.encode(three))  # a third call is past the cap


def test_a_namespaced_tool_name_walks_through_the_grammar(factory, tokenizer):
    tools = [{"type": "function", "function": {"name": "math.factorial", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]
    text = format_tool_calls([ToolCall(name="math.factorial", arguments={"n": 5})])
    assert walk(factory(tool_call_grammar(tools, "required")), tokenizer.encode(text) + [EOS])


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>\n{"name": "calculator", "arguments": {"expression":  "1"}}\n</tool_call>',  # padding
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1", "x": 2}}\n</tool_call>',
        '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call>',
        "Plain text is not a call.",
    ],
)
def test_required_grammar_refuses_padding_extra_arguments_unknown_tools_and_prose(factory, tokenizer, text):
    assert not walk(factory(tool_call_grammar(TOOLS, "required")), tokenizer.encode(text))


def test_auto_grammar_takes_prose_or_one_call_but_not_prose_holding_a_call(factory, tokenizer):
    grammar = tool_call_grammar(TOOLS, "auto")
    call = format_tool_calls([ToolCall(name="clock", arguments={"timezone": "Europe/Paris"})])
    assert walk(factory(grammar), tokenizer.encode("It is sunny.") + [EOS])
    assert walk(factory(grammar), tokenizer.encode(call) + [EOS])
    assert not walk(factory(grammar), tokenizer.encode("Let me see. " + call))
    assert not factory(grammar).allowed_mask()[1]  # <|im_start|> is no text


def test_string_arguments_are_bounded_by_max_length(factory, tokenizer):
    grammar = tool_call_grammar(TOOLS, "calculator", max_string_length=5)
    ok = format_tool_calls([ToolCall(name="calculator", arguments={"expression": "12345"})])
    too_long = format_tool_calls([ToolCall(name="calculator", arguments={"expression": "123456"})])
    assert walk(factory(grammar), tokenizer.encode(ok))
    assert not walk(factory(grammar), tokenizer.encode(too_long))


def test_refs_to_defs_in_a_tool_schema_are_followed(factory, tokenizer):
    tool = {
        "type": "function",
        "function": {
            "name": "move",
            "parameters": {
                "type": "object",
                "properties": {"to": {"$ref": "#/$defs/Point"}},
                "required": ["to"],
                "additionalProperties": False,
                "$defs": {
                    "Point": {
                        "type": "object",
                        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                        "required": ["x", "y"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    }
    grammar = tool_call_grammar([tool], "required")
    good = format_tool_calls([ToolCall(name="move", arguments={"to": {"x": 1, "y": -2}})])
    bad = format_tool_calls([ToolCall(name="move", arguments={"to": {"x": "1", "y": -2}})])
    assert walk(factory(grammar), tokenizer.encode(good) + [EOS])
    assert not walk(factory(grammar), tokenizer.encode(bad))


@settings(max_examples=30, deadline=None)
@given(st.text(alphabet="abc ,.?0123456789\n", min_size=1, max_size=40))
def test_eos_is_allowed_exactly_when_the_grammar_accepts(factory, tokenizer, text):
    constraint = factory('start: "A" /[a-c ,.?0-9\\n]*/ "!"')
    assert walk(constraint, tokenizer.encode("A" + text))  # every step checks EOS ⇔ accepting
    assert not constraint.allowed_mask()[EOS] and not constraint.is_accepting()  # "!" still due
    assert walk(constraint, tokenizer.encode("!"))
    assert constraint.allowed_mask()[EOS] and constraint.is_accepting()


def test_a_disallowed_token_raises_constraint_error_and_names_the_token(factory, tokenizer):
    constraint = factory(tool_call_grammar(TOOLS, "required"))
    with pytest.raises(ConstraintError, match="token 5 is not allowed"):
        constraint.advance(5)
    with pytest.raises(ConstraintError):
        constraint.allowed_mask()  # the matcher stays in its error state


def test_a_token_outside_the_vocabulary_raises_constraint_error(factory):
    with pytest.raises(ConstraintError, match="outside the vocabulary"):
        factory("start: /[a-z]+/").advance(VOCAB)


def test_a_broken_grammar_raises_constraint_error_with_llguidance_message(factory):
    with pytest.raises(ConstraintError, match="does not compile.*undefined|unknown|foo"):
        factory("start: foo")


def test_constraints_from_one_cached_grammar_are_independent(factory, tokenizer):
    grammar = tool_call_grammar(TOOLS, "auto")
    first = factory(grammar)
    assert walk(first, tokenizer.encode("Hello"))
    second = factory(grammar)
    assert not second.is_accepting() and first.is_accepting()


def test_json_schema_grammars_from_llguidance_work_too(factory, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    grammar = llguidance.grammar_from("json_schema", json.dumps(schema))
    assert walk(factory(grammar), tokenizer.encode('{"a": 12}') + [EOS])


# ---- SentencePiece and tokenizer.json vocabularies (issue 25 items 1 and 2) ------------------

ZOO = Path(__file__).resolve().parent / "data" / "zoo"
SP_TOKENS = ["<unk>", "<s>", "</s>", "<start_of_turn>", "\u2581a", "<0x41>", "<tool_call>", "a", "\u2581", "b"]
"""A SentencePiece vocabulary as a GGUF stores it: ▁ for a space, <0xNN> byte tokens."""
SP_TYPES = [2, 3, 3, 3, 1, 6, 4, 1, 1, 1]
"""llama.cpp token types: UNKNOWN, CONTROL ×3, NORMAL, BYTE, USER_DEFINED, NORMAL ×3."""


def _allows_text(llt: llguidance.LLTokenizer, grammar: str, ids: Sequence[int]) -> bool:
    """True when a matcher over ``llt`` accepts ``ids`` one by one and then the grammar accepts."""
    matcher = llguidance.LLMatcher(llt, grammar, log_level=0)
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


@pytest.mark.parametrize("tokenizer_model", ["llama", None])  # None: told by its <0xNN> tokens
def test_sentencepiece_tokens_decode_to_their_bytes(tokenizer_model):
    llt = llg_tokenizer_from_gguf_vocab(SP_TOKENS, eos_token_id=2, vocab_size=16, token_types=SP_TYPES,
                                        tokenizer_model=tokenizer_model)
    assert llt.decode_bytes([4]) == b" a" and llt.decode_bytes([5]) == b"A"
    assert llt.decode_bytes([8, 9]) == b" b"
    assert llt.is_special_token(3) and llt.is_special_token(2)
    assert _allows_text(llt, 'start: " aA"', [4, 5])


def test_a_user_defined_token_that_looks_like_markup_stays_ordinary_text():
    llt = llg_tokenizer_from_gguf_vocab(SP_TOKENS, eos_token_id=2, vocab_size=16, token_types=SP_TYPES)
    assert not llt.is_special_token(6)
    assert _allows_text(llt, 'start: "<tool_call>" "a"', [6, 7])


def test_a_gpt2_vocabulary_is_not_read_as_sentencepiece(vocab):
    llt = llg_tokenizer_from_gguf_vocab(vocab["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=VOCAB,
                                        tokenizer_model="gpt2")
    assert llt.decode_bytes([vocab["tokenizer.ggml.tokens"].index("Ġthe")]) == b" the"


def test_tokenizer_json_keeps_qwens_tool_call_ordinary_and_its_chatml_markers_special():
    text = (ZOO / "qwen2_5" / "tokenizer.json").read_text(encoding="utf-8")
    factory = ConstraintFactory.from_tokenizer_json(text, eos_token_id=[2, 0], vocab_size=2400)
    llt = factory.tokenizer
    assert factory.vocab_size == llt.vocab_size == 2400
    assert llt.is_special_token(2) and llt.is_special_token(1) and not llt.is_special_token(2382)
    assert llt.decode_bytes([2382]) == b"<tool_call>"
    constraint = factory('start: "<tool_call>" /[a-z]+/')
    assert constraint.allowed_mask()[2382]
    constraint.advance(2382)
    assert not factory("start: /[a-z]+/").allowed_mask()[2384:].any()  # past the tokenizer: padding


def test_tokenizer_json_of_a_sentencepiece_vocabulary_decodes_spaces_and_bytes():
    text = (ZOO / "gemma3" / "tokenizer.json").read_text(encoding="utf-8")
    vocab = json.loads(text)["model"]["vocab"]
    llt = ConstraintFactory.from_tokenizer_json(text, eos_token_id=[1, 5], vocab_size=3000).tokenizer
    assert llt.decode_bytes([vocab["\u2581a"]]) == b" a" and llt.decode_bytes([vocab["<0x41>"]]) == b"A"
    assert llt.is_special_token(5) and llt.eos_tokens == [1, 5]


def test_tokenizer_json_wider_than_the_logits_is_refused():
    text = (ZOO / "qwen2_5" / "tokenizer.json").read_text(encoding="utf-8")
    with pytest.raises(ConstraintError, match="vocab_size 2000"):
        ConstraintFactory.from_tokenizer_json(text, eos_token_id=2, vocab_size=2000)


# ---- the real model -------------------------------------------------------------------------

"""Room for the longest call the grammar allows (strings are bounded to 200 characters, at least
one per token, plus ~30 tokens of markup): a model that rambles inside a string is then still
forced to close the call, whatever this CPU's numerics make it ramble about."""


