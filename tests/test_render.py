"""Tests of chat rendering: prefix stability, spans, verbatim generated ids, tools, fallbacks."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.render import ChatRenderer, RenderedPrompt, default_tools_text
from agentkv.errors import UserError

SCHEMA = {
    "type": "function",
    "function": {"name": "calc", "description": "Evaluate.", "parameters": {"type": "object"}},
}
SPECIAL = {"<|im_start|>": 1, "<|im_end|>": 2}


class FakeChatML:
    """ChatML over a char-level vocab (<|im_start|> 1, <|im_end|> 2 = EOS, a char c → 10 + ord(c)),
    with switches for the template behaviours the renderer must cope with."""

    eos_token_id = 2

    def __init__(
        self,
        *,
        default_system: str | None = None,
        tool_role: str = "native",  # "native" | "raise" | "json" (openvino-genai's polyfill)
        native_tools: bool = False,
        merge_system: bool = False,  # Llama-2 style: not prefix-stable
        fail_on: str | None = None,  # raise when a message's content contains this text
    ) -> None:
        self.default_system, self.tool_role, self.native_tools = default_system, tool_role, native_tools
        self.merge_system, self.fail_on = merge_system, fail_on
        self.calls = 0
        self.chat_template = "{% for m in messages %}<|im_start|>{{ m.role }}...{% endfor %}"
        if native_tools:
            self.chat_template += "{% if tools %}# Tools{% endif %}"

    def encode(self, text: str) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            special = next((s for s in SPECIAL if text.startswith(s, i)), None)
            ids.append(SPECIAL[special] if special else 10 + ord(text[i]))
            i += len(special) if special else 1
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        names = {v: k for k, v in SPECIAL.items()}
        return "".join(names.get(i) or chr(i - 10) for i in ids)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool, tools: Any = None
    ) -> str:
        self.calls += 1
        turns = [(m["role"], m["content"]) for m in messages]
        if self.fail_on and any(self.fail_on in content for _, content in turns):
            raise ValueError("template error")
        if self.native_tools and tools:
            listing = "# Tools\n" + "\n".join(json.dumps(t) for t in tools)
            if turns and turns[0][0] == "system":
                turns[0] = ("system", f"{turns[0][1]}\n\n{listing}")
            else:
                turns.insert(0, ("system", listing))
        elif turns and turns[0][0] != "system" and self.default_system is not None:
            turns.insert(0, ("system", self.default_system))
        if self.merge_system and len(turns) > 1 and turns[0][0] == "system":
            turns[:2] = [(turns[1][0], f"{turns[0][1]}\n\n{turns[1][1]}")]
        text = "".join(self._turn(role, content) for role, content in turns)
        text += "<|im_start|>assistant\n" if add_generation_prompt else ""
        if not text:
            raise RuntimeError("Applied chat template resulted in an empty string")
        return text

    def _turn(self, role: str, content: str) -> str:
        if role == "tool" and self.tool_role == "raise":
            raise ValueError("Conversation roles must be user or assistant")
        if role == "tool" and self.tool_role == "json":
            role, content = "user", json.dumps({"tool_response": {"content": content}}, indent=2)
        return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@pytest.fixture(scope="module")
def real_tok():
    from agentkv.engine.openvino.models import resolve_model
    from agentkv.engine.openvino.tokenizer import OVTokenizer

    return OVTokenizer(resolve_model(None).ir_dir)


def dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


def span_text(tok: Any, prompt: RenderedPrompt, i: int) -> str:
    span = prompt.spans[i]
    return tok.decode(prompt.token_ids[span.start : span.end])


def assert_well_formed(prompt: RenderedPrompt, messages: Sequence[Message]) -> None:
    """One non-empty span per message, in order, contiguous, from the prefix to the generation prompt."""
    assert [(s.index, s.role) for s in prompt.spans] == [(i, m.role) for i, m in enumerate(messages)]
    body_end = len(prompt.token_ids) - prompt.generation_prompt_len
    if not messages:
        assert prompt.prefix_len == body_end
        return
    first = prompt.spans[0]
    if messages[0].role == "system":
        assert (first.start, first.end) == (0, prompt.prefix_len)
    else:
        assert first.start == prompt.prefix_len
    assert all(s.start < s.end for s in prompt.spans)
    assert all(a.end == b.start for a, b in zip(prompt.spans, prompt.spans[1:]))
    assert prompt.spans[-1].end == body_end


def assert_prefix_stable(
    make: Callable[[], ChatRenderer], messages: list[Message], tools: Sequence[dict[str, Any]]
) -> None:
    """Each prefix of the conversation, rendered by a fresh renderer, is a prefix of the whole."""
    renderer = make()
    full = renderer.render(messages, tools=tools)
    body = renderer.render(messages, tools=tools, add_generation_prompt=False)
    assert_well_formed(full, messages)
    assert_well_formed(body, messages)
    assert full.token_ids[: len(body.token_ids)] == body.token_ids
    assert len(full.token_ids) - len(body.token_ids) == full.generation_prompt_len > 0
    assert full.spans == body.spans and full.prefix_len == body.prefix_len
    for k in range(1, len(messages)):
        part = make().render(messages[:k], tools=tools, add_generation_prompt=False)
        assert body.token_ids[: len(part.token_ids)] == part.token_ids
        assert part.spans == body.spans[:k] and part.prefix_len == body.prefix_len


def conversations(max_id: int) -> st.SearchStrategy[tuple[list[Message], tuple[dict[str, Any], ...]]]:
    text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=12)
    generated = st.lists(st.integers(3, max_id), max_size=6).flatmap(
        lambda ids: st.sampled_from([ids, [*ids, 2]])
    )
    call = st.builds(lambda n, v: ToolCall(name=n, arguments={"x": v}), text, text)
    message = st.one_of(
        st.builds(Message.user, text),
        st.builds(Message.assistant, text),
        st.builds(lambda c, ids: Message.assistant(c, token_ids=ids), text, generated),
        st.builds(
            lambda c, calls: Message.assistant(c, tool_calls=calls), text, st.lists(call, max_size=2)
        ),
        st.builds(lambda c: Message.tool(c, tool_call_id="call_1", name="calc"), text),
    )
    system = st.one_of(st.just([]), st.builds(lambda c: [Message.system(c)], text))
    body = st.lists(message, min_size=1, max_size=6)
    tools = st.sampled_from([(), (SCHEMA,)])
    return st.tuples(st.builds(lambda s, b: s + b, system, body), tools)


@settings(max_examples=150, deadline=None)
@given(conversations(max_id=500))
def test_rendering_is_prefix_stable_with_the_fake_tokenizer(case) -> None:
    messages, tools = case
    tok = FakeChatML(default_system="You are a fake.")
    assert_prefix_stable(lambda: ChatRenderer(tok), messages, tools)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=conversations(max_id=49151))
def test_rendering_is_prefix_stable_with_the_real_tokenizer(real_tok, case) -> None:
    messages, tools = case
    assert_prefix_stable(lambda: ChatRenderer(real_tok), messages, tools)


@settings(max_examples=60, deadline=None)
@given(conversations(max_id=500))
def test_message_tokens_equals_the_span_length(case) -> None:
    messages, _ = case
    renderer = ChatRenderer(FakeChatML(default_system="You are a fake."))
    prompt = renderer.render(messages)
    assert [renderer.message_tokens(m, position=i) for i, m in enumerate(messages)] == [
        len(s) for s in prompt.spans
    ]


def test_message_tokens_equals_the_span_length_with_the_real_tokenizer(real_tok) -> None:
    renderer = ChatRenderer(real_tok)
    result = Message.tool("4", tool_call_id="c", name="calc")
    messages = [Message.user("What is 2+2?"), Message.assistant("4"), result]
    for conversation in (messages, [Message.system("Be brief."), *messages]):
        prompt = renderer.render(conversation)
        counts = [renderer.message_tokens(m, position=i) for i, m in enumerate(conversation)]
        assert counts == [len(s) for s in prompt.spans]


@pytest.mark.parametrize("generation", [True, False])
@pytest.mark.parametrize(
    "messages",
    [
        [Message.user("Hi there")],
        [
            Message.system("You are terse."),
            Message.user("Hi"),
            Message.assistant("Hello!"),
            Message.user("Bye"),
        ],
        [Message.user("Ça va ?"), Message.assistant("Oui.\nEt toi ?"), Message.user("  spaces  ")],
    ],
)
def test_plain_conversations_decode_to_the_templates_own_text(real_tok, messages, generation) -> None:
    prompt = ChatRenderer(real_tok).render(messages, add_generation_prompt=generation)
    text = real_tok.apply_chat_template(dicts(messages), add_generation_prompt=generation)
    assert real_tok.decode(prompt.token_ids) == text
    assert list(prompt.token_ids) == real_tok.encode(text)


def test_injected_default_system_prompt_is_a_synthetic_prefix_outside_the_spans(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([Message.user("Hi")])
    prefix = real_tok.decode(prompt.token_ids[: prompt.prefix_len])
    assert prefix.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.spans[0].start == prompt.prefix_len
    assert span_text(real_tok, prompt, 0) == "<|im_start|>user\nHi<|im_end|>\n"


def test_leading_system_message_is_the_prefix(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([Message.system("Be brief."), Message.user("Hi")])
    assert prompt.prefix_len == prompt.spans[0].end
    assert real_tok.decode(prompt.token_ids[: prompt.prefix_len]) == "<|im_start|>system\nBe brief.<|im_end|>\n"


def test_generation_prompt_is_the_assistant_header(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([Message.user("Hi")])
    header = prompt.token_ids[len(prompt.token_ids) - prompt.generation_prompt_len :]
    assert real_tok.decode(header) == "<|im_start|>assistant\n"


def test_empty_conversation_is_only_the_generation_prompt(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([])
    assert prompt.spans == () and prompt.prefix_len == 0
    assert real_tok.decode(prompt.token_ids) == "<|im_start|>assistant\n"


def test_generated_token_ids_render_verbatim_without_a_second_eos(real_tok) -> None:
    generated = [*real_tok.encode("Hel"), *real_tok.encode("lo world"), real_tok.eos_token_id]
    assert generated[:-1] != real_tok.encode("Hello world")
    prompt = ChatRenderer(real_tok).render(
        [Message.user("Hi"), Message.assistant("Hello world", token_ids=generated)], add_generation_prompt=False
    )
    span = prompt.spans[1]
    expected = [*real_tok.encode("<|im_start|>assistant\n"), *generated, *real_tok.encode("\n")]
    assert list(prompt.token_ids[span.start : span.end]) == expected


def test_generated_token_ids_without_eos_get_the_whole_footer(real_tok) -> None:
    generated = real_tok.encode("Hel") + real_tok.encode("lo")
    prompt = ChatRenderer(real_tok).render([Message.user("Hi"), Message.assistant("Hello", token_ids=generated)])
    assert span_text(real_tok, prompt, 1) == "<|im_start|>assistant\nHello<|im_end|>\n"
    span = prompt.spans[1]
    assert list(prompt.token_ids[span.start : span.end])[4 : 4 + len(generated)] == generated


def test_next_turn_reuses_every_token_the_model_read(real_tok) -> None:
    renderer = ChatRenderer(real_tok)
    history = [Message.system("Be brief."), Message.user("Hi")]
    asked = renderer.render(history)
    generated = [*real_tok.encode("Hel"), *real_tok.encode("lo"), real_tok.eos_token_id]
    history += [Message.assistant("Hello", token_ids=generated), Message.user("Bye")]
    read_by_model = (*asked.token_ids, *generated[:-1])
    assert renderer.render(history).token_ids[: len(read_by_model)] == read_by_model


def test_tool_calls_render_as_tool_call_blocks(real_tok) -> None:
    calls = [ToolCall(name="calc", arguments={"expr": "1+1", "note": "é"}), ToolCall(name="now")]
    message = Message.assistant("Let me check.", tool_calls=calls)
    prompt = ChatRenderer(real_tok).render([Message.user("Hi"), message])
    assert span_text(real_tok, prompt, 1) == (
        "<|im_start|>assistant\nLet me check.\n"
        '<tool_call>\n{"name": "calc", "arguments": {"expr": "1+1", "note": "é"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call><|im_end|>\n'
    )


def test_rendered_tool_calls_parse_back_to_the_same_calls() -> None:
    from agentkv.chat.toolcalls import parse_tool_calls

    tok = FakeChatML()
    calls = (ToolCall(name="calc", arguments={"expr": "1+1"}), ToolCall(name="now"))
    prompt = ChatRenderer(tok).render([Message.user("Hi"), Message.assistant("Sure.", tool_calls=calls)])
    body = span_text(tok, prompt, 1).removeprefix("<|im_start|>assistant\n").removesuffix("<|im_end|>\n")
    parsed = parse_tool_calls(body)
    assert parsed.content == "Sure."
    assert [(c.name, c.arguments) for c in parsed.tool_calls] == [(c.name, c.arguments) for c in calls]


def test_tool_results_become_tool_response_user_turns_when_the_template_rewrites_them(real_tok) -> None:
    renderer = ChatRenderer(real_tok)  # openvino-genai's polyfill would turn them into JSON
    prompt = renderer.render([Message.user("Hi"), Message.tool("2", tool_call_id="c", name="calc")])
    assert not renderer.native_tool_role
    assert span_text(real_tok, prompt, 1) == "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"
    assert prompt.spans[1].role == "tool"


@pytest.mark.parametrize(
    ("tool_role", "expected"),
    [
        ("native", "<|im_start|>tool\n2<|im_end|>\n"),
        ("raise", "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"),
        ("json", "<|im_start|>user\n<tool_response>\n2\n</tool_response><|im_end|>\n"),
    ],
)
def test_tool_results_use_the_tool_role_only_when_the_template_shows_them_verbatim(
    tool_role, expected
) -> None:
    tok = FakeChatML(tool_role=tool_role)
    result = Message.tool("2", tool_call_id="c", name="calc")
    prompt = ChatRenderer(tok).render([Message.user("Hi"), result])
    assert span_text(tok, prompt, 1) == expected


def test_tools_text_is_appended_to_the_system_span(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([Message.system("Be brief."), Message.user("Hi")], tools=[SCHEMA])
    system = span_text(real_tok, prompt, 0)
    assert system == f"<|im_start|>system\nBe brief.\n\n{default_tools_text([SCHEMA])}<|im_end|>\n"
    assert json.dumps(SCHEMA) in system and "<tool_call>" in system
    assert prompt.prefix_len == prompt.spans[0].end


def test_tools_without_a_system_message_make_a_synthetic_system_prefix(real_tok) -> None:
    prompt = ChatRenderer(real_tok).render([Message.user("Hi")], tools=[SCHEMA])
    prefix = real_tok.decode(prompt.token_ids[: prompt.prefix_len])
    assert prefix == f"<|im_start|>system\n{default_tools_text([SCHEMA])}<|im_end|>\n"
    assert prompt.spans[0].start == prompt.prefix_len
    assert "SmolLM" not in real_tok.decode(prompt.token_ids)


def test_custom_tools_text_is_used() -> None:
    tok = FakeChatML()
    renderer = ChatRenderer(tok, tools_text=lambda tools: f"{len(tools)} tools")
    prompt = renderer.render([Message.system("S")], tools=[SCHEMA, SCHEMA])
    assert span_text(tok, prompt, 0) == "<|im_start|>system\nS\n\n2 tools<|im_end|>\n"


def test_native_tools_go_through_the_template_when_it_references_them() -> None:
    tok = FakeChatML(native_tools=True)
    renderer = ChatRenderer(tok)
    prompt = renderer.render([Message.user("Hi")], tools=[SCHEMA])
    prefix = tok.decode(prompt.token_ids[: prompt.prefix_len])
    assert renderer.native_tools
    assert prefix == f"<|im_start|>system\n# Tools\n{json.dumps(SCHEMA)}<|im_end|>\n"
    assert "You can call these tools" not in tok.decode(prompt.token_ids)
    assert not ChatRenderer(FakeChatML()).native_tools


def test_message_the_template_cannot_render_is_rendered_in_chatml_with_a_warning(caplog) -> None:
    tok = FakeChatML(fail_on="BOOM")
    messages = [Message.user("Hi"), Message.assistant("BOOM"), Message.user("after")]
    with caplog.at_level(logging.WARNING, logger="agentkv.chat.render"):
        prompt = ChatRenderer(tok).render(messages)
    assert "rendering that message in ChatML" in caplog.text
    assert span_text(tok, prompt, 1) == "<|im_start|>assistant\nBOOM<|im_end|>\n"
    assert_prefix_stable(lambda: ChatRenderer(tok), messages, ())


def test_rendering_an_extended_conversation_renders_only_the_new_message() -> None:
    tok = FakeChatML(default_system="You are a fake.")
    renderer = ChatRenderer(tok)
    messages = [
        Message.user(f"question {i}") if i % 2 == 0 else Message.assistant(f"answer {i}")
        for i in range(40)
    ]
    renderer.render(messages)
    tok.calls = 0
    extended = renderer.render([*messages, Message.user("one more")])
    assert tok.calls <= 4
    assert extended == ChatRenderer(tok).render([*messages, Message.user("one more")])


def test_misuse_raises_user_error() -> None:
    renderer = ChatRenderer(FakeChatML())
    with pytest.raises(UserError, match="pass Message objects"):
        renderer.render([{"role": "user", "content": "hi"}])  # type: ignore[list-item]
    with pytest.raises(UserError, match="position"):
        renderer.message_tokens(Message.user("hi"), position=-1)


def test_same_text_with_other_generated_ids_renders_those_ids() -> None:
    tok = FakeChatML()
    renderer = ChatRenderer(tok)
    first = renderer.render([Message.user("Hi"), Message.assistant("ab", token_ids=[5001, 5002, 2])])
    second = renderer.render([Message.user("Hi"), Message.assistant("ab", token_ids=[5003, 2])])
    assert 5001 in first.token_ids and 5003 not in first.token_ids
    assert 5003 in second.token_ids and 5001 not in second.token_ids
