"""A reasoning model's earlier thinking: rendered where its template shows it, dropped from the KV where it does not.

The fake template does what Qwen3's does with an assistant message holding ``<think>…</think>``:
the thinking is shown for assistant turns after the last user message, and only the answer for
turns before it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv import Agent, Runtime
from agentkv.chat.messages import Message
from agentkv.chat.render import ChatRenderer
from agentkv.errors import UserError
from agentkv.run.past_reasoning import left_out_reasoning
from agentkv.testing import ScriptedEngine
from agentkv.testing.tokenizer import ScriptedTokenizer
from test_render import FakeChatML

THINK, END_THINK = 3, 4


class FakeQwen3(FakeChatML):
    """ChatML whose template splits an assistant's ``<think>`` block off as Qwen3's does."""

    def __init__(self) -> None:
        super().__init__()
        self.chat_template += "{% if '</think>' in content %}<think>{% endif %}"

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for i, part in enumerate(text.replace("</think>", "\x00E\x00").replace("<think>", "\x00T\x00").split("\x00")):
            if i % 2 == 0:
                ids += super().encode(part)
            else:
                ids += [THINK] if part == "T" else [END_THINK] if part == "E" else super().encode(part)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return "".join("<think>" if i == THINK else "</think>" if i == END_THINK else FakeChatML.decode(self, [i])
                       for i in ids)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], *, add_generation_prompt: bool,
                            tools: Any = None) -> str:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
        shown = []
        for i, message in enumerate(messages):
            content = message["content"]
            if message["role"] == "assistant":  # NOTE: as Qwen3: an empty block on the last turn
                reasoning, answer = "", content
                if "</think>" in content:
                    reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n")
                    answer = content.split("</think>")[-1].lstrip("\n")
                shown_block = i > last_user and (reasoning or i == len(messages) - 1)
                content = f"<think>\n{reasoning}\n</think>\n\n{answer}" if shown_block else answer
            shown.append({**message, "content": content})
        return super().apply_chat_template(shown, add_generation_prompt=add_generation_prompt, tools=tools)


def thinking_answer(tok: FakeQwen3, reasoning: str, answer: str) -> Message:
    text = f"<think>\n{reasoning}\n</think>\n\n{answer}"
    return Message.assistant(answer, token_ids=(*tok.encode(text), tok.eos_token_id))


def test_the_renderer_knows_the_reasoning_tags_from_the_template() -> None:
    assert ChatRenderer(FakeQwen3()).reasoning_tags == ("<think>", "</think>")
    assert ChatRenderer(FakeChatML()).reasoning_tags is None


def test_thinking_before_the_last_user_turn_is_left_out_and_the_answer_kept_verbatim() -> None:
    tok = FakeQwen3()
    renderer = ChatRenderer(tok)
    answer = thinking_answer(tok, "plan", "Hello")
    prompt = renderer.render([Message.system("S"), Message.user("Hi"), answer, Message.user("Again")])
    text = tok.decode(prompt.token_ids)
    assert "plan" not in text and "<|im_start|>assistant\nHello<|im_end|>\n<|im_start|>user\nAgain" in text
    expected = tok.apply_chat_template([{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                                        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nHello"},
                                        {"role": "user", "content": "Again"}], add_generation_prompt=True)
    assert text == expected


def test_thinking_of_the_current_turn_stays_verbatim_in_a_tool_loop() -> None:
    tok = FakeQwen3()
    renderer = ChatRenderer(tok)
    answer = thinking_answer(tok, "call it", "<tool_call>x</tool_call>")
    prompt = renderer.render([Message.system("S"), Message.user("Hi"), answer,
                              Message.tool("2", tool_call_id="c", name="calc")])
    span = prompt.token_ids[prompt.spans[2].start: prompt.spans[2].end]
    generated = tuple(answer.token_ids or ())
    assert any(span[i: i + len(generated)] == generated for i in range(len(span)))
    assert "call it" in tok.decode(span)


def test_the_next_turns_prompt_is_the_kv_without_the_thinking_block() -> None:
    tok = FakeQwen3()
    renderer = ChatRenderer(tok)
    first = renderer.render([Message.system("S"), Message.user("Hi")])
    answer = thinking_answer(tok, "plan", "Hello")
    kv = (*first.token_ids, *(answer.token_ids or ())[:-1])
    second = renderer.render([Message.system("S"), Message.user("Hi"), answer, Message.user("Again")])
    spans = left_out_reasoning(kv, second.token_ids, THINK, END_THINK)
    assert len(spans) == 1
    start, end = spans[0]
    assert tok.decode(kv[start:end]) == "<think>\nplan\n</think>\n\n"
    kept = (*kv[:start], *kv[end:])
    assert second.token_ids[: len(kept)] == kept


ids = st.lists(st.integers(10, 40), max_size=12)


@given(ids, st.lists(st.tuples(ids, ids.filter(bool)), max_size=3), ids)
@settings(max_examples=200, deadline=None)
def test_left_out_thinking_blocks_are_found_exactly(head: list[int], turns: list[tuple[list[int], list[int]]],
                                                   tail: list[int]) -> None:
    """KV = head + (block + answer)*; prompt = head + answer* + tail: the spans are the blocks."""
    kv, prompt, expected = list(head), list(head), []
    for reasoning, answer in turns:
        block = [THINK, *reasoning, END_THINK, 5]
        expected.append((len(kv), len(kv) + len(block)))
        kv += block + answer
        prompt += answer
    prompt += tail
    assert left_out_reasoning(kv, prompt, THINK, END_THINK) == expected


def test_a_difference_that_is_no_thinking_block_is_left_to_the_session() -> None:
    assert left_out_reasoning([1, 2, 9, 9, 3], [1, 2, 3], THINK, END_THINK) == []
    assert left_out_reasoning([1, THINK, 7, 3], [1, 3], THINK, END_THINK) == []  # never closed


# ---- through the runner (ScriptedEngine: its vocabulary has <think> and </think> as single tokens) ----

class ScriptedQwen3(ScriptedTokenizer):
    """The scripted ChatML tokenizer with Qwen3's way of showing an assistant's thinking."""

    @property
    def chat_template(self) -> str:
        return "{# reasoning_content: <think> … </think> #}"

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool,
                            tools: Any = None) -> str:
        return super().apply_chat_template(qwen3_shown(messages), add_generation_prompt=add_generation_prompt)


def qwen3_shown(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as Qwen3's template shows them: thinking (a ``reasoning_content`` field or a
    ``<think>`` block in the content) only after the last user turn, an empty block on a last answer."""
    last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=-1)
    shown = []
    for i, message in enumerate(messages):
        content = str(message.get("content") or "")
        if message["role"] == "assistant":
            reasoning = str(message.get("reasoning_content") or "")
            if "</think>" in content:
                reasoning = content.split("</think>")[0].split("<think>")[-1].strip("\n")
                content = content.split("</think>")[-1].lstrip("\n")
            if i > last_user and (reasoning or i == len(messages) - 1):
                content = f"<think>\n{reasoning}\n</think>\n\n{content}"
        shown.append({**message, "content": content})
    return shown


def qwen3_runtime(replies: list[str], agent: Agent, *, exact: bool = False) -> tuple[Runtime, ScriptedEngine]:
    engine = ScriptedEngine(replies, exact=exact)
    runtime = Runtime(engine, agents=[agent])
    runtime.renderer = ChatRenderer(ScriptedQwen3(), stop_token_ids=engine.eos_token_ids)
    return runtime, engine


@pytest.mark.parametrize("past_reasoning", ["shift", "reprefill"])
async def test_the_next_turn_drops_the_last_turns_thinking_from_the_kv_or_rereads_after_it(past_reasoning: str) -> None:
    agent = Agent(name="thinker", instructions="Be brief.", past_reasoning=past_reasoning)  # type: ignore[arg-type]
    runtime, engine = qwen3_runtime(["<think>\nplan the answer with care\n</think>\n\nFirst answer.",
                                     "Second answer."], agent)
    conversation = await runtime.open_conversation(agent)
    first = await runtime.run(conversation, "Hi")
    assert (first.final_text, first.reasoning) == ("First answer.", "plan the answer with care")
    held = len(conversation.kv.tokens)
    second = await runtime.run(conversation, "Again")
    assert second.final_text == "Second answer."
    think_block = len(engine.tokenizer.encode("<think>\nplan the answer with care\n</think>\n\n"))
    metrics = second.call_metrics[0]
    prompt = conversation.render(agent, add_generation_prompt=False)
    kv = conversation.kv.tokens
    assert prompt.token_ids[: len(kv)] == kv and len(prompt.token_ids) - len(kv) <= 2  # all but the end markup
    if past_reasoning == "shift":
        assert conversation.kv.shifted
        assert metrics.reused_tokens == held - think_block  # everything but the thinking stayed
    else:
        assert not conversation.kv.shifted
        assert metrics.reused_tokens < held - think_block  # re-read from the thinking on
    await runtime.aclose()


@pytest.mark.parametrize("exact", [False, True])
async def test_by_default_thinking_leaves_by_a_shift_but_is_reread_under_exact_numerics(exact: bool) -> None:
    agent = Agent(name="thinker", instructions="Be brief.")
    assert agent.past_reasoning == "auto"
    runtime, _ = qwen3_runtime(["<think>\nplan the answer with care\n</think>\n\nFirst answer.",
                                "Second answer."], agent, exact=exact)
    conversation = await runtime.open_conversation(agent)
    await runtime.run(conversation, "Hi")
    await runtime.run(conversation, "Again")
    # exact numerics promise bit-exact KV: a shifted KV is only close to a fresh prefill
    assert conversation.kv.shifted is not exact
    await runtime.aclose()


@pytest.mark.parametrize("mode", ["shift", "reprefill"])
async def test_an_explicit_past_reasoning_holds_whatever_the_numerics(mode: str) -> None:
    agent = Agent(name="thinker", instructions="Be brief.", past_reasoning=mode)  # type: ignore[arg-type]
    runtime, _ = qwen3_runtime(["<think>\nplan\n</think>\n\nFirst.", "Second."], agent, exact=True)
    conversation = await runtime.open_conversation(agent)
    await runtime.run(conversation, "Hi")
    await runtime.run(conversation, "Again")
    assert conversation.kv.shifted is (mode == "shift")
    await runtime.aclose()


def test_an_unknown_past_reasoning_is_refused_naming_the_choices() -> None:
    with pytest.raises(UserError, match="'auto' \\(the default\\), 'shift' or 'reprefill'"):
        Agent(name="thinker", past_reasoning="drop")  # type: ignore[arg-type]


async def test_a_model_whose_kv_cannot_shift_rereads_after_the_thinking_instead_of_failing() -> None:
    agent = Agent(name="thinker", instructions="Be brief.")
    runtime, engine = qwen3_runtime(["<think>\nplan\n</think>\n\nFirst.", "Second."], agent)

    async def no_rope() -> None:
        return None

    engine.backend.rope_convention = no_rope  # type: ignore[method-assign]  # its keys fit no rotation
    conversation = await runtime.open_conversation(agent)
    await runtime.run(conversation, "Hi")
    second = await runtime.run(conversation, "Again")
    assert second.final_text == "Second." and not conversation.kv.shifted
    assert any("re-read, not shifted" in note for note in conversation.call_checks.operations)
    await runtime.aclose()


async def test_a_snapshot_keeps_the_last_answers_thinking_and_a_resume_shifts_it_out(tmp_path) -> None:
    """The history a snapshot is cut to leaves the last answer's thinking out (the next user turn
    will), yet the KV holding it is all usable: the snapshot keeps it, and a resume in a new
    runtime restores all of it and drops the block by a shift, prefilling only the new turn."""
    from agentkv.memory import Store

    agent = Agent(name="thinker", instructions="Be brief.")
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    store = Store(url)
    engine = ScriptedEngine(["<think>\nplan the answer with care\n</think>\n\nFirst answer."])
    runtime = Runtime(engine, store, agents=[agent])
    runtime.renderer = ChatRenderer(ScriptedQwen3(), stop_token_ids=engine.eos_token_ids)
    conversation = await runtime.open_conversation(agent)
    await runtime.run(conversation, "Hi")
    held = conversation.kv.tokens
    [record, *_] = await store.snapshots(conversation.id)
    assert record.num_tokens == len(held)
    await runtime.aclose()
    await store.close()

    store = Store(url)
    engine = ScriptedEngine(["Second answer."])
    runtime = Runtime(engine, store, agents=[agent])
    runtime.renderer = ChatRenderer(ScriptedQwen3(), stop_token_ids=engine.eos_token_ids)
    resumed = await runtime.resume(conversation.id, agent)
    assert resumed.kv.tokens == held
    second = await runtime.run(resumed, "Again")
    think_block = len(engine.tokenizer.encode("<think>\nplan the answer with care\n</think>\n\n"))
    assert second.call_metrics[0].reused_tokens == len(held) - think_block and resumed.kv.shifted
    await runtime.aclose()
    await store.close()
