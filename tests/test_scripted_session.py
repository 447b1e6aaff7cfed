"""agentkv.testing: the scripted tokenizer, and the scripted session's trim/fork/snapshot/restore and errors."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.kv.snapshot import KVSnapshot
from agentkv.errors import (
    ContextOverflowError,
    KVSessionClosed,
    SnapshotIncompatible,
    UserError,
)
from agentkv.testing import ScriptedEngine, ScriptedTokenizer
from agentkv.testing.fake_kv import HEAD_DIM

CFG = GenerationConfig(max_new_tokens=64)


def render(tok: ScriptedTokenizer, messages: list[dict[str, str]]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))


def user_prompt(engine: ScriptedEngine, text: str = "hi") -> list[int]:
    return render(engine.tokenizer, [{"role": "user", "content": text}])


# ---- tokenizer ---------------------------------------------------------------------------
def test_chatml_markers_and_thinking_tags_are_single_special_ids_after_the_base_vocabulary():
    tok = ScriptedTokenizer()
    assert tok.encode("<|im_start|>") == [tok.bos_token_id]
    assert tok.encode("<|im_end|>") == [tok.eos_token_id]
    assert {tok.bos_token_id, tok.eos_token_id} == {100277, 100278}
    assert tok.encode("<think></think>") == [100279, 100280]  # a reasoning model's tags
    assert tok.n_vocab == 100281
    assert tok.decode([tok.eos_token_id]) == "<|im_end|>"


def test_chat_template_renders_chatml_without_a_default_system_prompt():
    tok = ScriptedTokenizer()
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tools=[{"name": "calc"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(messages[:1], add_generation_prompt=False).endswith("hi<|im_end|>\n")
    assert tok.decode(tok.encode(text)) == text
    assert "im_start" in tok.chat_template


def test_chat_template_rejects_non_text_content_and_missing_roles():
    tok = ScriptedTokenizer()
    with pytest.raises(UserError, match="content must be a string"):
        tok.apply_chat_template([{"role": "user", "content": [1]}], add_generation_prompt=True)
    with pytest.raises(UserError, match="role"):
        tok.apply_chat_template([{"content": "x"}], add_generation_prompt=True)


def test_count_tokens_counts_encoded_ids():
    tok = ScriptedTokenizer()
    assert tok.count_tokens("hello world") == len(tok.encode("hello world")) == 2
    assert tok.count_tokens("") == 0


# ---- session operations ----------------------------------------------------------------------
async def test_fork_copies_the_log_and_counts_it_as_restored_then_diverges():
    engine = ScriptedEngine(["parent", "child", "parent again"])
    parent = await engine.open_session()
    prompt = user_prompt(engine)
    await parent.generate(prompt, CFG)
    child = await parent.fork()
    assert child.tokens == parent.tokens and child.id != parent.id
    follow = list(parent.tokens) + engine.tokenizer.encode("<|im_end|>\n<|im_start|>user\nmore")
    child_result = await child.generate(follow, CFG)
    assert child_result.metrics.restored_tokens == child_result.metrics.reused_tokens == len(prompt) + 1
    await parent.generate(prompt + engine.tokenizer.encode("x"), CFG)
    assert parent.tokens[: len(child.tokens)] != child.tokens


async def test_snapshot_and_restore_round_trip_the_log():
    engine = ScriptedEngine(["saved", "after restore"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    await session.generate(prompt, CFG)
    snap = await session.snapshot()
    assert isinstance(snap, KVSnapshot) and snap.tokens == session.tokens
    assert snap.fingerprint == "scripted" and snap.keys.shape == (1, 1, 1, len(session.tokens), HEAD_DIM)
    fresh = await engine.open_session()
    await fresh.restore(snap)
    assert fresh.tokens == session.tokens
    again = await fresh.generate(list(snap.tokens) + engine.tokenizer.encode("!"), CFG)
    assert again.metrics.restored_tokens == again.metrics.reused_tokens == len(snap.tokens)


async def test_restoring_another_models_snapshot_is_refused_and_changes_nothing():
    engine = ScriptedEngine(["kept"])
    session = await engine.open_session()
    await session.generate(user_prompt(engine), CFG)
    before = session.tokens
    zeros = np.zeros((1, 1, 1, 2, 1), dtype=np.float32)
    foreign = KVSnapshot.from_float([1, 2], zeros, zeros, precision="f32", fingerprint="other-model")
    with pytest.raises(SnapshotIncompatible, match="re-prefill"):
        await session.restore(foreign)
    assert session.tokens == before


async def test_trim_keeps_a_prefix_and_the_next_prompt_refeeds_from_there():
    engine = ScriptedEngine(["reply"])
    session = await engine.open_session()
    prompt = user_prompt(engine)
    await session.prefill(prompt)
    await session.trim(4)
    assert session.tokens == tuple(prompt[:4])
    await session.trim(100)  # longer than the log: nothing changes
    assert session.tokens == tuple(prompt[:4])
    with pytest.raises(UserError, match="n >= 0"):
        await session.trim(-1)
    result = await session.generate(prompt, CFG)
    assert (result.metrics.reused_tokens, result.metrics.prefilled_tokens) == (4, len(prompt) - 4)


async def test_next_token_logits_depend_only_on_the_log():
    engine = ScriptedEngine()
    a, b = await engine.open_session(), await engine.open_session()
    prompt = user_prompt(engine)
    await a.prefill(prompt)
    await b.prefill(prompt + [11])
    await b.trim(len(prompt))
    la, lb = await a.next_token_logits(), await b.next_token_logits()
    assert la.dtype == np.float32 and la.shape == (engine.tokenizer.n_vocab,)
    assert np.array_equal(la, lb) and b.tokens == tuple(prompt)
    await b.prefill(prompt + [11])
    assert not np.array_equal(la, await b.next_token_logits())
    with pytest.raises(UserError, match="empty"):
        await (await engine.open_session()).next_token_logits()


# ---- errors ----------------------------------------------------------------------------------
async def test_an_overflowing_prompt_raises_before_the_log_changes():
    engine = ScriptedEngine(["unused"], max_context_len=16)
    session = await engine.open_session()
    await session.prefill([1, 2, 3])
    with pytest.raises(ContextOverflowError, match="context-window policy") as info:
        session.stream(list(range(16)), CFG)
    assert (info.value.prompt_tokens, info.value.limit) == (16, 16)
    assert session.tokens == (1, 2, 3) and engine.calls == []


async def test_an_empty_prompt_is_a_user_error():
    engine = ScriptedEngine()
    session = await engine.open_session()
    with pytest.raises(UserError, match="empty"):
        await session.generate([], CFG)
    with pytest.raises(UserError, match="empty"):
        await session.prefill([])


async def test_a_closed_session_refuses_every_operation_and_closing_twice_is_harmless():
    engine = ScriptedEngine()
    session = await engine.open_session()
    await session.prefill([1, 2])
    snap = await session.snapshot()
    await session.close()
    await session.close()
    assert session.tokens == ()
    for operation in (
        lambda: session.generate([1], CFG),
        lambda: session.prefill([1]),
        session.next_token_logits,
        lambda: session.trim(0),
        session.fork,
        session.snapshot,
        lambda: session.restore(snap),
    ):
        with pytest.raises(KVSessionClosed, match="open_session"):
            await operation()


async def test_aclose_closes_every_open_session_and_prefixes_are_recorded():
    engine = ScriptedEngine()
    sessions = [await engine.open_session() for _ in range(3)]
    engine.register_prefix([1, 2, 3])
    assert engine.registered_prefixes == [(1, 2, 3)]
    await engine.aclose()
    for session in sessions:
        with pytest.raises(KVSessionClosed):
            await session.prefill([1])
