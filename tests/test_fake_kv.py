"""The scripted engine runs the engine's own session code over fake KV slots: alignment, trim,
fork, offload, snapshot / restore, RoPE drops and the prefix cache keep the KV invariant there."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.engine.base import GenerationConfig
from agentkv.kv.log import KVLogCorrupt
from agentkv.kv.rope import RopeConvention
from agentkv.engine.session.session import SlotSession
from agentkv.errors import SnapshotIncompatible
from agentkv.testing import FakeSlot, ScriptedEngine
from agentkv.testing.fake_kv import HEAD_DIM, ROPE_THETA, fake_keys, fake_logits, held_tokens

CFG = GenerationConfig(max_new_tokens=16)


async def assert_kv_is_a_fresh_prefill(session: SlotSession) -> None:
    """The invariant: the session's KV is what prefilling ``session.tokens`` at 0.. would hold."""
    snap = await session.snapshot()
    keys, values = snap.to_float()
    assert snap.tokens == session.tokens
    assert held_tokens(values) == list(session.tokens)
    np.testing.assert_allclose(keys[0, 0, 0], fake_keys(session.tokens, 0), atol=1e-4)
    await session.check_integrity()


# ---- the fake slot itself ------------------------------------------------------------------
def test_a_fake_slot_holds_rotated_keys_and_values_naming_its_tokens():
    slot = FakeSlot(vocab_size=50)
    logits = slot.feed(np.array([[5, 6, 7]]), past_len=0)
    assert logits.shape == (1, 50) and logits.dtype == np.float32
    keys, values = slot.read()
    assert keys.shape == values.shape == (1, 1, 1, 3, HEAD_DIM)
    assert held_tokens(values) == [5, 6, 7]
    np.testing.assert_allclose(keys[0, 0, 0], fake_keys([5, 6, 7], 0), atol=1e-6)
    slot.trim(2)
    assert slot.length() == 2
    np.testing.assert_array_equal(slot.feed(np.array([[7]]), past_len=2), logits)  # same log, same logits


def test_logits_follow_the_tokens_the_values_name_not_the_call_history():
    a, b = FakeSlot(vocab_size=100), FakeSlot(vocab_size=100)
    a.feed(np.array([[1, 2, 3]]), past_len=0)
    b.feed(np.array([[1]]), past_len=0)
    b.feed(np.array([[2, 3]]), past_len=1)
    assert np.array_equal(a.feed(np.array([[4]]), 3), b.feed(np.array([[4]]), 3))
    assert not np.array_equal(fake_logits([1, 2, 3, 4], 100), fake_logits([1, 2, 3, 5], 100))


def test_keys_written_at_the_wrong_positions_fail_the_next_step():
    slot = FakeSlot(vocab_size=10)
    slot.feed(np.array([[1, 2, 3, 4]]), past_len=0)
    keys, values = slot.read()
    slot.write(np.concatenate([keys[..., :1, :], keys[..., 2:, :]], axis=-2),  # drop token 2 without re-rotating
               np.concatenate([values[..., :1, :], values[..., 2:, :]], axis=-2))
    with pytest.raises(KVLogCorrupt, match="wrong positions"):
        slot.feed(np.array([[5]]), past_len=3)


def test_a_write_of_another_layout_is_refused_with_a_clear_error():
    slot = FakeSlot(vocab_size=10)
    wrong = np.zeros((2, 1, 4, 3, 64), dtype=np.float32)
    with pytest.raises(SnapshotIncompatible, match="ScriptedEngine"):
        slot.write(wrong, wrong)


# ---- the real session code on it ---------------------------------------------------------
async def test_the_scripted_engine_measures_its_rope_with_the_engines_own_procedure():
    engine = ScriptedEngine()
    convention = await engine.rope_convention()
    assert isinstance(convention, RopeConvention)
    assert convention.source == "metadata" and convention.theta == ROPE_THETA
    assert convention.inv_freq == pytest.approx((1.0,)) and convention.fit_error < 1e-4
    assert engine.pool.size == 16


async def test_a_drop_re_rotates_later_keys_so_the_kv_equals_a_fresh_prefill_of_what_is_left():
    engine = ScriptedEngine(["reply one"])
    session = await engine.open_session()
    await session.prefill(list(range(100, 140)))
    await session.drop(5, 25)
    assert session.shifted and session.drops == [(5, 25)]
    await assert_kv_is_a_fresh_prefill(session)
    result = await session.generate([*session.tokens, 7], CFG)  # the next step checks every key
    assert result.metrics.reused_tokens == 20


async def test_sessions_beyond_the_slots_are_offloaded_and_come_back_whole():
    engine = ScriptedEngine(["a1", "b1", "a2", "b2"], num_slots=1)
    a, b = await engine.open_session(), await engine.open_session()
    prompt_a, prompt_b = list(range(10, 40)), list(range(50, 70))
    await a.generate(prompt_a, CFG)
    await b.generate(prompt_b, CFG)  # a's KV goes to the host
    held = len(a.tokens)
    again = await a.generate([*a.tokens, 1], CFG)
    assert engine.pool.offloads == 2
    assert again.metrics.restored_tokens == again.metrics.reused_tokens == held > len(prompt_a)
    await assert_kv_is_a_fresh_prefill(a)
    await b.generate([*b.tokens, 2], CFG)
    await assert_kv_is_a_fresh_prefill(b)


async def test_a_restored_snapshot_whose_values_were_tampered_with_changes_what_the_model_says():
    engine = ScriptedEngine()
    session = await engine.open_session()
    await session.prefill(list(range(1, 20)))
    honest = await session.next_token_logits()
    snap = await session.snapshot()
    keys, values = snap.to_float()
    values[..., 3, 0] = 999.0  # the KV now names another token at position 3
    forged = type(snap).from_float(snap.tokens, keys, values, precision="f32", fingerprint=snap.fingerprint)
    other = await engine.open_session()
    await other.restore(forged)
    assert other.tokens == session.tokens  # the log cannot tell…
    with pytest.raises(KVLogCorrupt):  # …but the fake model can: key 3 is not token 999's rotation
        await other.next_token_logits()
    assert honest.shape == (engine.tokenizer.n_vocab,)


async def test_a_prefix_cache_hit_on_the_scripted_engine_gives_the_kv_of_a_cold_prefill():
    engine = ScriptedEngine(["one", "two"], prefix_cache_bytes=None)
    prefix = list(range(200, 260))
    engine.register_prefix(prefix)
    first = await engine.open_session()
    await first.generate([*prefix, 1, 2], CFG)
    second = await engine.open_session()
    result = await second.generate([*prefix, 3, 4], CFG)
    assert result.metrics.prefix_cache_tokens == len(prefix)
    await assert_kv_is_a_fresh_prefill(second)


OPERATIONS = st.lists(
    st.tuples(st.sampled_from(["prefill", "trim", "drop", "fork", "restore", "generate", "switch"]),
              st.integers(0, 60), st.integers(0, 60)),
    min_size=1, max_size=12,
)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(operations=OPERATIONS)
async def test_the_kv_invariant_holds_through_any_sequence_of_session_operations(operations):
    engine = ScriptedEngine(num_slots=2)
    engine.add_replies(*(["ok then"] * len(operations)))
    sessions = [await engine.open_session()]
    current = sessions[0]
    for name, x, y in operations:
        n = len(current.tokens)
        if name == "prefill":
            await current.prefill([*current.tokens[: min(x, n)], *range(300, 300 + y + 1)])
        elif name == "trim":
            await current.trim(min(x, n))
        elif name == "drop" and n:
            start, end = sorted((x % (n + 1), y % (n + 1)))
            await current.drop(start, end)
        elif name == "fork":
            current = await current.fork()
            sessions.append(current)
        elif name == "restore" and n:
            snap = await current.snapshot()
            current = await engine.open_session()
            sessions.append(current)
            await current.restore(snap)
        elif name == "generate":
            await current.generate([*current.tokens, 5 + x], CFG)
        elif name == "switch":
            current = sessions[x % len(sessions)]  # other sessions get offloaded and come back
        for session in sessions:
            if session.tokens:
                await assert_kv_is_a_fresh_prefill(session)
    await engine.aclose()
