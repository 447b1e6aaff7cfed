"""Templates that are not prefix-stable render each conversation exactly as the template does.

The fake templates reproduce, over a character vocabulary, what the real families do (the real
templates are checked on the model zoo in tests/model/test_zoo_render_model.py): Qwen3's empty
``<think>`` block on the last assistant turn only, Phi-3.5's end-of-text after a last assistant
turn, Mistral Nemo's system prompt inside the last user turn, Gemma's system prompt merged into the
first user turn, Gemma 3's role-alternation check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.render import ChatRenderer, RenderedPrompt, default_tools_text
from agentkv.chat.toolcalls import format_tool_calls
from test_render import SCHEMA, FakeChatML

THINK = "<think>\n\n</think>\n\n"


class FakeFamily(FakeChatML):
    """FakeChatML with one family's way of not being prefix-stable."""

    def __init__(self, style: str, **switches: Any) -> None:
        super().__init__(**switches)
        self.style = style
        self.chat_template += "{{ tools }}{{ tool_calls }}" if switches.get("native_tools") else ""

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                            tools: Any = None) -> str:
        dicts = [dict(m) for m in messages]
        if self.style == "alternate":  # Gemma 3: roles must alternate user/assistant after a system
            roles = [m["role"] for m in dicts if m["role"] != "system"]
            if any(r == ("assistant" if i % 2 == 0 else "user") for i, r in enumerate(roles)):
                raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        if self.style == "think_last" and dicts and dicts[-1]["role"] == "assistant":
            dicts[-1]["content"] = THINK + dicts[-1]["content"]
        if self.style in ("system_last", "system_first_user", "alternate") and dicts and dicts[0]["role"] == "system":
            users = [i for i, m in enumerate(dicts) if m["role"] == "user"]
            if users:
                system = dicts.pop(0)
                target = users[-1 if self.style == "system_last" else 0] - 1
                dicts[target]["content"] = f"{system['content']}\n\n{dicts[target]['content']}"
            elif self.style == "system_first_user":  # Gemma 2: alone, the system prompt is a user turn
                dicts[0]["role"] = "user"
            elif self.style == "alternate":  # Gemma 3: alone, it renders as nothing
                dicts.pop(0)
        text = super().apply_chat_template(dicts, add_generation_prompt=add_generation_prompt, tools=tools) \
            if dicts or add_generation_prompt else "<|im_start|>"
        if self.style == "eos_last" and not add_generation_prompt and dicts and dicts[-1]["role"] == "assistant":
            text += "<|im_end|>"
        return text


def payloads(messages: Sequence[Message]) -> list[dict[str, Any]]:
    return [{"role": m.role, "content": m.content} for m in messages]


CONVERSATION = [
    Message.system("Be brief."),
    Message.user("Hi"),
    Message.assistant("Hello"),
    Message.user("Sum 2 and 3"),
    Message.assistant("5"),
    Message.user("Bye"),
]
STYLES = ["think_last", "eos_last", "system_last", "system_first_user"]


def assert_contiguous(prompt: RenderedPrompt, count: int) -> None:
    assert len(prompt.spans) == count
    for left, right in zip(prompt.spans, prompt.spans[1:]):
        assert left.end == right.start and left.start <= left.end
    if prompt.spans:
        assert prompt.spans[-1].end == len(prompt.token_ids) - prompt.generation_prompt_len


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("length", range(1, len(CONVERSATION) + 1))
def test_every_conversation_renders_exactly_as_the_template_does(style: str, length: int) -> None:
    tok = FakeFamily(style)
    renderer = ChatRenderer(tok)
    messages = CONVERSATION[:length]
    prompt = renderer.render(messages)
    assert renderer.whole_conversations and renderer.uses_template
    assert tok.decode(prompt.token_ids) == tok.apply_chat_template(payloads(messages), add_generation_prompt=True)
    assert_contiguous(prompt, length)


@pytest.mark.parametrize("style", STYLES)
def test_the_history_of_a_conversation_ending_in_a_user_turn_is_the_prompt_without_its_generation_prompt(
        style: str) -> None:
    renderer = ChatRenderer(FakeFamily(style))
    prompt = renderer.render(CONVERSATION)
    history = renderer.render(CONVERSATION, add_generation_prompt=False)
    assert history.token_ids == prompt.token_ids[: len(prompt.token_ids) - prompt.generation_prompt_len]
    assert history.spans == prompt.spans and history.generation_prompt_len == 0


def test_a_history_ending_in_an_answer_is_what_the_next_user_turn_reads() -> None:
    """Qwen3's template adds an empty <think> block to the last assistant turn only: the history
    (what a snapshot keeps, what a resume restores) leaves it out, as the next turn will."""
    tok = FakeFamily("think_last")
    renderer = ChatRenderer(tok)
    generated = (*tok.encode("Hello"), tok.eos_token_id)
    history = [*CONVERSATION[:2], Message.assistant("Hello", token_ids=generated)]
    body = renderer.render(history, add_generation_prompt=False)
    next_turn = renderer.render([*history, Message.user("Again")])
    assert THINK not in tok.decode(body.token_ids)
    assert next_turn.token_ids[: len(body.token_ids)] == body.token_ids
    assert next_turn.spans[: len(body.spans)] == body.spans and body.generation_prompt_len == 0


def test_phi_end_of_text_after_a_last_answer_is_not_part_of_the_history() -> None:
    tok = FakeFamily("eos_last")
    history = ChatRenderer(tok).render(CONVERSATION[:3], add_generation_prompt=False)
    assert tok.decode(history.token_ids).endswith("Hello<|im_end|>\n")


def test_qwen3_generated_answer_is_read_back_verbatim_and_the_next_turn_reuses_all_of_it() -> None:
    """Turn 1's prompt plus the generated ids (ending in the stop token) is where turn 2's prompt
    starts: no <think> is added to an answer that is no longer the last message."""
    tok = FakeFamily("think_last")
    renderer = ChatRenderer(tok)
    turn_one = renderer.render(CONVERSATION[:2])
    generated = (*tok.encode("Hello"), tok.eos_token_id)
    answer = Message.assistant("Hello", token_ids=generated)
    turn_two = renderer.render([*CONVERSATION[:2], answer, Message.user("Again")])
    read = (*turn_one.token_ids, *generated)
    assert turn_two.token_ids[: len(read)] == read
    assert turn_two.spans[2].start == len(turn_one.token_ids) - turn_one.generation_prompt_len


@given(st.lists(st.sampled_from(["u", "a"]), min_size=1, max_size=8), st.sampled_from(STYLES))
@settings(max_examples=60, deadline=None)
def test_generated_ids_render_where_the_template_puts_their_text(roles: list[str], style: str) -> None:
    """With generated ids standing for the text they decode to, the prompt equals the template's."""
    tok = FakeFamily(style)
    renderer = ChatRenderer(tok)
    messages = [Message.system("S")]
    for i, role in enumerate(roles):
        text = f"m{i}"
        messages.append(Message.user(text) if role == "u"
                        else Message.assistant(text, token_ids=(*tok.encode(text), 2)))
    prompt = renderer.render(messages)
    expected = tok.apply_chat_template(payloads(messages), add_generation_prompt=True)
    assert tok.decode(prompt.token_ids) == expected
    assert_contiguous(prompt, len(messages))


def test_a_system_prompt_merged_into_the_first_user_turn_owns_the_text_before_its_content() -> None:
    tok = FakeFamily("system_first_user")
    renderer = ChatRenderer(tok)
    prompt = renderer.render(CONVERSATION[:2])
    system = tok.decode(prompt.token_ids[prompt.spans[0].start: prompt.spans[0].end])
    assert system == "<|im_start|>user\nBe brief.\n\n"
    assert prompt.prefix_len == prompt.spans[0].end
    other = renderer.render([CONVERSATION[0], Message.user("Something else")])
    assert other.token_ids[: other.prefix_len] == prompt.token_ids[: prompt.prefix_len]


def test_gemma3_like_merge_on_a_prefix_stable_template_registers_the_shared_system_text() -> None:
    """A template that is prefix-stable but renders a system message alone as nothing (Gemma 3:
    its text appears in the first user turn) still gives the system span that text."""
    tok = FakeFamily("alternate")
    renderer = ChatRenderer(tok)
    assert not renderer.whole_conversations
    prompt = renderer.render(CONVERSATION[:4])
    expected = tok.apply_chat_template(payloads(CONVERSATION[:4]), add_generation_prompt=True)
    assert tok.decode(prompt.token_ids) == expected
    assert tok.decode(prompt.token_ids[: prompt.prefix_len]) == "<|im_start|>user\nBe brief.\n\n"
    assert_contiguous(prompt, 4)


def test_message_tokens_are_counted_by_a_template_that_checks_role_order(caplog) -> None:
    tok = FakeFamily("alternate")
    renderer = ChatRenderer(tok)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat.render"):
        count = renderer.message_tokens(Message.assistant("Hello"), position=3)
    assert count == len(tok.encode("<|im_start|>assistant\nHello<|im_end|>\n"))
    assert "ChatML" not in caplog.text


def test_mistral_native_tools_go_to_the_template_and_are_never_dropped() -> None:
    tok = FakeFamily("system_last", native_tools=True)
    renderer = ChatRenderer(tok)
    assert renderer.native_tools
    prompt = renderer.render(CONVERSATION[:4], tools=[SCHEMA])
    text = tok.decode(prompt.token_ids)
    assert text == tok.apply_chat_template(payloads(CONVERSATION[:4]), add_generation_prompt=True, tools=[SCHEMA])
    assert '"name": "calc"' in text


def test_a_conversation_the_template_cannot_render_goes_to_chatml_with_the_tools_as_text(caplog) -> None:
    tok = FakeFamily("think_last", fail_on="BOOM", native_tools=True)
    renderer = ChatRenderer(tok)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat.render"):
        prompt = renderer.render([Message.system("S"), Message.user("BOOM")], tools=[SCHEMA])
    assert "rendering it in ChatML, tools as text" in caplog.text
    assert tok.decode(prompt.token_ids) == (
        f"<|im_start|>system\nS\n\n{default_tools_text([SCHEMA])}<|im_end|>\n"
        "<|im_start|>user\nBOOM<|im_end|>\n<|im_start|>assistant\n"
    )


def test_whole_renders_are_cached() -> None:
    tok = FakeFamily("system_last")
    renderer = ChatRenderer(tok)
    renderer.render(CONVERSATION)
    tok.calls = 0
    assert renderer.render(CONVERSATION) == ChatRenderer(FakeFamily("system_last")).render(CONVERSATION)
    assert tok.calls == 0


@pytest.mark.parametrize("style", ["segments", "system_last"])
def test_a_generated_stop_token_gives_way_to_the_different_one_the_footer_starts_with(style: str) -> None:
    """Llama 3.1 may stop a call on <|eom_id|> while its template closes the turn with <|eot_id|>:
    the rendering holds the template's token only (the generated stop token is never read)."""
    tok = FakeChatML() if style == "segments" else FakeFamily(style)
    other_stop = 7  # a second stop token (the model stopped on it), not the footer's <|im_end|> (2)
    renderer = ChatRenderer(tok, stop_token_ids=[other_stop])
    answer = Message.assistant("Hi", token_ids=(*tok.encode("Hi"), other_stop))
    prompt = renderer.render([Message.user("Q"), answer, Message.user("R")])
    assert other_stop not in prompt.token_ids
    assert tok.decode(prompt.token_ids).count("Hi<|im_end|>") == 1


class FakeMistralCalls(FakeFamily):
    """Mistral Nemo's ways with tool calls: the system prompt inside the last user turn, an
    assistant's calls rendered from its ``tool_calls`` (its content ignored), and a role-alternation
    check that skips calling messages and tool results."""

    def __init__(self) -> None:
        super().__init__("system_last", native_tools=True)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                            tools: Any = None) -> str:
        counted = [m for m in messages[1:] if m["role"] != "tool" and not m.get("tool_calls")]
        if messages and messages[0]["role"] != "system":
            counted = [m for m in messages if m["role"] != "tool" and not m.get("tool_calls")]
        if any((m["role"] == "user") != (i % 2 == 0) for i, m in enumerate(counted)):
            raise ValueError("After the optional system message, conversation roles must alternate")
        shown = [{**m, "content": format_tool_calls([ToolCall(id=c["id"], name=c["function"]["name"],
                                                              arguments=c["function"]["arguments"])
                                                     for c in m["tool_calls"]])}
                 if m.get("tool_calls") else m for m in messages]
        return super().apply_chat_template(shown, add_generation_prompt=add_generation_prompt, tools=tools)


def template_dicts(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Messages as a template with its own tool-call rendering takes them."""
    dicts: list[dict[str, Any]] = []
    for m in messages:
        payload: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            payload["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        if m.role == "tool":
            payload.update(tool_call_id=m.tool_call_id, name=m.name)
        dicts.append(payload)
    return dicts


def test_a_tool_round_trip_renders_with_a_template_that_skips_calls_in_its_role_check(caplog) -> None:
    """Mistral Nemo's template counts neither calling messages nor tool results in its
    user/assistant alternation: shown as text, a generated call broke the alternation once an
    answer followed the result, and the whole history fell back to ChatML. Shown to the template
    as calls, every step of the round trip renders as the template does, the generated ids read
    verbatim."""
    tok = FakeMistralCalls()
    renderer = ChatRenderer(tok)
    assert renderer.whole_conversations and renderer.native_tool_calls
    call = ToolCall(id="a1b2c3d4e", name="calc", arguments={"expr": "1+1"})
    written = (*tok.encode(format_tool_calls([call])), tok.eos_token_id)
    history = [Message.system("Be brief."), Message.user("Hi"),
               Message.assistant("", tool_calls=[call], token_ids=written),
               Message.tool("2", tool_call_id=call.id, name="calc"),
               Message.assistant("Two", token_ids=(*tok.encode("Two"), tok.eos_token_id)), Message.user("Bye")]
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        prompts = {n: renderer.render(history[:n], tools=[SCHEMA]) for n in range(2, len(history) + 1)}
        body = renderer.render(history[:5], tools=[SCHEMA], add_generation_prompt=False)
    assert caplog.records == []
    for n, prompt in prompts.items():
        expected = tok.apply_chat_template(template_dicts(history[:n]), add_generation_prompt=True, tools=[SCHEMA])
        assert tok.decode(prompt.token_ids) == expected
        assert_contiguous(prompt, n)
    assert prompts[6].token_ids[: len(body.token_ids)] == body.token_ids  # what the next turn reads
    assert tok.decode(body.token_ids).endswith(f"{format_tool_calls([call])}<|im_end|>\n"
                                               "<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\nTwo<|im_end|>\n")


def test_a_user_message_quoting_a_generated_call_keeps_its_own_span_and_the_call_its_ids() -> None:
    tok = FakeMistralCalls()
    renderer = ChatRenderer(tok)
    call = ToolCall(id="a1b2c3d4e", name="calc", arguments={"expr": "1+1"})
    text = format_tool_calls([call])
    written = (*tok.encode(text), tok.eos_token_id)
    history = [Message.system("Be brief."), Message.user(f"Please emit exactly: {text}"),
               Message.assistant("", tool_calls=[call], token_ids=written),
               Message.tool("2", tool_call_id=call.id, name="calc"),
               Message.assistant("Two", token_ids=(*tok.encode("Two"), tok.eos_token_id)), Message.user("Bye")]
    prompt = renderer.render(history, tools=[SCHEMA])
    expected = tok.apply_chat_template(template_dicts(history), add_generation_prompt=True, tools=[SCHEMA])
    assert tok.decode(prompt.token_ids) == expected
    assert_contiguous(prompt, len(history))
    user, assistant = prompt.spans[1], prompt.spans[2]
    assert "Please emit exactly" in tok.decode(prompt.token_ids[user.start:user.end])
    ids, call_ids = prompt.token_ids[assistant.start:assistant.end], written[:-1]
    assert any(ids[i:i + len(call_ids)] == call_ids for i in range(len(ids)))  # the generated ids, verbatim
