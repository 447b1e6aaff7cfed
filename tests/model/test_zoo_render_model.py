"""Every zoo family's real chat template renders exactly, and its KV is reused where the template allows.

Tokenizers only (no model is compiled). Per family: a conversation renders to the template's own
text (decode(ids) == template text, ids == encode(text)), with its tool schemas when the template
shows tools; the next turn's prompt starts with this turn's prompt plus the generated answer; a
tool loop's next call does too; the system span covers what every conversation of the agent
shares. What each family reuses across turns, and why (the README's families table says it too):

- Qwen2.5, Llama 3.1, Gemma 3: prefix-stable; everything is reused.
- Qwen3: adds an empty ``<think>`` block to the last assistant turn only; a generated answer
  renders verbatim, and once the next user turn follows it, the template drops that block, so the
  KV of the answer as generated is what the next turn reads: everything is reused.
- Phi-3.5: ``<|endoftext|>`` after a last assistant turn; the history leaves it out (no next turn
  reads it): everything is reused.
- Gemma 2: the system prompt is merged into the first user turn: everything is reused.
- Mistral Nemo: the system prompt (and the tool schemas) go into the *last* user turn, and the
  system prompt is left out while the last message is a tool result. So each new user turn, and
  each tool loop step, re-reads everything after the first ``[INST]``: the template's design, kept
  because that is what the model was trained on.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.render import ChatRenderer, RenderedPrompt
from agentkv.chat.toolcalls import format_tool_calls

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "reference.json").is_file()) if ZOO.is_dir() else []
END_OF_TURN = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>", "llama3_1": "<|eot_id|>",
               "mistral_nemo": "</s>", "phi3_5": "<|end|>", "qwen2_5": "<|im_end|>", "qwen3": "<|im_end|>"}
MOVES_THE_SYSTEM_PROMPT = {"mistral_nemo"}
MERGES_THE_SYSTEM_PROMPT = {"gemma2", "gemma3"}
SCHEMA = {"type": "function", "function": {"name": "calc", "description": "Evaluate.", "parameters": {
    "type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}
CONVERSATION = [Message.system("Be brief."), Message.user("Hi"), Message.assistant("Hello"), Message.user("Bye")]

_TOKENIZERS: dict[str, Any] = {}


def tokenizer(family: str) -> Any:
    from agentkv.engine.openvino.tokenizer import OVTokenizer

    if family not in _TOKENIZERS:
        _TOKENIZERS[family] = OVTokenizer(ZOO / family)
    return _TOKENIZERS[family]


def stop_ids(family: str) -> frozenset[int]:
    ids = json.loads((ZOO / family / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"]
    return frozenset(ids if isinstance(ids, list) else [ids])


def renderer(family: str) -> ChatRenderer:
    return ChatRenderer(tokenizer(family), stop_token_ids=stop_ids(family))


def reused(kv: tuple[int, ...], prompt: RenderedPrompt) -> int:
    n = 0
    while n < min(len(kv), len(prompt.token_ids)) and kv[n] == prompt.token_ids[n]:
        n += 1
    return n


def generated(family: str, text: str) -> tuple[int, ...]:
    """What the model writes for ``text``: its ids and the end-of-turn token it stops on."""
    tok = tokenizer(family)
    (stop,) = tok.encode(END_OF_TURN[family])
    assert stop in stop_ids(family)
    return (*tok.encode(text), stop)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_tools", [False, True])
def test_a_conversation_renders_exactly_as_the_template_does(family: str, with_tools: bool, caplog) -> None:
    tok = tokenizer(family)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        chat = renderer(family)
        if with_tools and not chat.native_tools:
            pytest.skip(f"{family}'s template shows no tools: they are a system-prompt text")
        tools = [SCHEMA] if with_tools else []
        prompt = chat.render(CONVERSATION, tools=tools)
    assert chat.uses_template and "ChatML" not in caplog.text
    expected = tok.apply_chat_template([{"role": m.role, "content": m.content} for m in CONVERSATION],
                                       add_generation_prompt=True, tools=tools or None)
    assert tok.decode(prompt.token_ids) == expected
    assert list(prompt.token_ids) == list(tok.encode(expected))
    if with_tools:
        assert '"calc"' in expected


@pytest.mark.parametrize("family", FAMILIES)
def test_the_next_turn_starts_with_this_turns_prompt_and_answer(family: str) -> None:
    chat = renderer(family)
    turn_one = chat.render(CONVERSATION[:2], tools=[SCHEMA])
    answer = generated(family, "Hello there")
    turn_two = chat.render([*CONVERSATION[:2], Message.assistant("Hello there", token_ids=answer),
                            Message.user("Bye")], tools=[SCHEMA])
    kv = (*turn_one.token_ids, *answer[:-1])  # the stop token is generated, not yet read
    if family in MOVES_THE_SYSTEM_PROMPT:
        assert reused(kv, turn_two) < turn_one.spans[1].start + 2
    else:
        assert reused(kv, turn_two) == len(kv)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_loops_next_call_reads_all_of_the_kv(family: str) -> None:
    chat = renderer(family)
    call = ToolCall(id="abcdefghi", name="calc", arguments={"expr": "1+1"})
    first = chat.render(CONVERSATION[:2], tools=[SCHEMA])
    answer = generated(family, format_tool_calls([call]))
    second = chat.render([*CONVERSATION[:2], Message.assistant("", tool_calls=[call], token_ids=answer),
                          Message.tool("2", tool_call_id=call.id, name="calc")], tools=[SCHEMA])
    kv = (*first.token_ids, *answer[:-1])
    if family in MOVES_THE_SYSTEM_PROMPT:  # the system prompt leaves while a tool result is last
        assert reused(kv, second) < len(kv)
    else:
        assert reused(kv, second) == len(kv)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_system_span_holds_the_system_prompt_and_is_shared_by_every_first_turn(family: str) -> None:
    tok = tokenizer(family)
    chat = renderer(family)
    one = chat.render([CONVERSATION[0], Message.user("Hi")])
    other = chat.render([CONVERSATION[0], Message.user("Something else entirely")])
    assert one.prefix_len == one.spans[0].end
    assert "Be brief." in tok.decode(one.token_ids[: one.prefix_len])
    assert one.token_ids[: one.prefix_len] == other.token_ids[: other.prefix_len]


@pytest.mark.parametrize("family", FAMILIES)
def test_message_budgets_are_counted_by_the_template(family: str, caplog) -> None:
    chat = renderer(family)
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        counts = [chat.message_tokens(m, position=i) for i, m in enumerate(CONVERSATION)]
    assert all(count > 0 for count in counts[1:]) and "ChatML" not in caplog.text


@pytest.mark.parametrize("family", FAMILIES)
def test_a_messages_budget_is_its_span_in_a_real_conversation(family: str) -> None:
    """``message_tokens`` counts a message where it usually sits; in a conversation its span has
    that many tokens (the system prompt with the text a merging template puts before the first
    user turn's content; later user turns with their own header)."""
    chat = renderer(family)
    conversation = [*CONVERSATION, Message.assistant("Goodbye")]
    spans = chat.render(conversation, add_generation_prompt=False).spans
    if family in MOVES_THE_SYSTEM_PROMPT:  # the system prompt sits in the last user turn: no fixed place
        conversation, spans = conversation[1:], spans[1:]
    first = len(CONVERSATION) + 1 - len(conversation)
    counts = [chat.message_tokens(m, position=i) for i, m in enumerate(conversation, start=first)]
    real = [len(span) for span in spans]
    if family in MERGES_THE_SYSTEM_PROMPT:  # the first user turn's header is in the system span
        assert counts[1] - real[1] == real[3] - len(tokenizer(family).encode("Bye<end_of_turn>\n"))
        counts, real = [counts[0], *counts[2:]], [real[0], *real[2:]]
    assert counts == real


def _template_dicts(messages: list[Message], chat: ChatRenderer) -> list[dict[str, Any]]:
    """``messages`` as the template takes them natively: calls as ``tool_calls``, results as role tool."""
    dicts: list[dict[str, Any]] = []
    for m in messages:
        payload: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            payload["tool_calls"] = [{"id": chat.tool_format.call_id(c.id), "type": "function",
                                      "function": {"name": c.name, "arguments": c.arguments}} for c in m.tool_calls]
        if m.role == "tool":
            payload.update(tool_call_id=chat.tool_format.call_id(m.tool_call_id or ""), name=m.name)
        dicts.append(payload)
    return dicts


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tool_round_trip_renders_with_the_familys_own_template(family: str, caplog) -> None:
    """Call, result, answer, next user turn: no step falls back to ChatML (Mistral Nemo's did once
    an answer followed a tool result: its role-alternation check skips calling messages, which the
    renderer showed it as text); where the template renders calls and results itself, the text is
    the template's own, the generated ids read verbatim."""
    tok = tokenizer(family)
    chat = renderer(family)
    call = ToolCall(id="abcdefghi", name="calc", arguments={"expr": "1+1"})
    calling = generated(family, chat.tool_format.format_calls([call]))
    history = [*CONVERSATION[:2], Message.assistant("", tool_calls=[call], token_ids=calling),
               Message.tool("2", tool_call_id=call.id, name="calc"),
               Message.assistant("Two", token_ids=generated(family, "Two")), Message.user("Thanks")]
    with caplog.at_level(logging.WARNING, logger="agentkv.chat"):
        prompts = [chat.render(history[:n], tools=[SCHEMA]) for n in range(3, len(history) + 1)]
    assert caplog.records == []
    if chat.native_tool_calls and chat.native_tool_role:
        for prompt, n in zip(prompts, range(3, len(history) + 1)):
            expected = tok.apply_chat_template(_template_dicts(history[:n], chat), add_generation_prompt=True,
                                               tools=[SCHEMA] if chat.native_tools else None)
            assert tok.decode(prompt.token_ids) == expected
