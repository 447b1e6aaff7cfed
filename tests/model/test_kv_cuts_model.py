"""On the real default model, a session's KV knows where the passes that computed it began: a
turn's cuts are its prompt's canonical chunk starts plus one per decoded token, a prefix-cache
hit leaves the cuts (and block keys) a cold start does, and snapshots carry the cuts through
files, restores, forks, spans and joins, bit for bit.

The tests here run the real model; the scripted ones are in ``tests/test_kv_cuts.py``,
``tests/test_snapshot_cuts.py`` and ``tests/test_prefix_cuts.py``."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.chunking import chunk_spans
from agentkv.kv.snapshot import KVSnapshot

pytestmark = pytest.mark.model

ANSWER = GenerationConfig(max_new_tokens=6, ignore_eos=True, prompt_lookup=False)  # one token a step
SYSTEM = ("You keep the lighthouse log of a small harbour. Note the weather, the ships that pass and "
          "the state of the lamp, in short plain sentences. ") * 2


def chat(engine, question: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def system_ids(engine) -> list[int]:
    """The prompt's tokens up to the user's turn: the prefix registered as shared."""
    prompt = chat(engine, "x")
    marker = engine.tokenizer.encode("<|im_start|>user")
    at = next(i for i in range(len(prompt)) if prompt[i : i + len(marker)] == marker)
    return prompt[:at]


def canonical_starts(engine, prompt: list[int]) -> list[int]:
    """Where a cold prefill of ``prompt`` begins its chunks (0 left out)."""
    backend = engine.backend
    cuts = backend.boundaries.cuts_within(prompt, start=0, stop=len(prompt))
    return [b for b, _ in chunk_spans(0, len(prompt), cuts=cuts, chunk_size=backend.prefill_chunk_size) if b]


def namespace(engine) -> KVNamespace:
    return KVNamespace(salt="", fingerprint=engine.fingerprint, layout="paged", precision="f16",
                       numerics="default", chunk_size=engine.backend.prefill_chunk_size)


async def test_a_turns_cuts_are_its_prompts_chunk_starts_and_one_per_decoded_token(engine):
    engine.register_prefix(system_ids(engine))
    prompt = chat(engine, "What did you see tonight?")
    session = await engine.open_session()
    try:
        result = await session.generate(prompt, ANSWER)
        fed = len(session.tokens) - len(prompt)  # the last chosen token is not fed yet
        assert fed == len(result.token_ids) - 1 > 0
        assert len(system_ids(engine)) in canonical_starts(engine, prompt)
        assert session.cuts == (*canonical_starts(engine, prompt), *range(len(prompt), len(prompt) + fed))
        fork = await session.fork()
        assert fork.cuts == session.cuts
        await fork.close()
    finally:
        await session.close()


async def test_a_prefix_hit_and_a_cold_start_leave_the_same_cuts_and_block_keys(engine, monkeypatch):
    if engine.backend.prefix_cache is None:
        pytest.skip("this engine runs without a prefix cache")
    engine.register_prefix(system_ids(engine))
    first = await engine.open_session()
    await first.prefill(chat(engine, "Is the lamp lit?"))  # the cache takes the system prompt
    await first.close()
    prompt = chat(engine, "Which ships passed the harbour today?")
    warm = await engine.open_session()
    metrics = await warm.prefill(prompt)
    assert metrics.prefix_cache_tokens >= len(system_ids(engine))
    with monkeypatch.context() as m:
        m.setattr(engine.backend, "prefix_cache", None)
        cold = await engine.open_session()
        assert (await cold.prefill(prompt)).prefix_cache_tokens == 0
    try:
        assert warm.cuts == cold.cuts == tuple(canonical_starts(engine, prompt))
        space = namespace(engine)
        assert space.chain(warm.tokens, cuts=warm.cuts).keys == space.chain(cold.tokens, cuts=cold.cuts).keys
    finally:
        await warm.close()
        await cold.close()


async def test_snapshot_file_restore_keep_the_cuts_and_spans_join_back_bit_for_bit(engine, tmp_path):
    session = await engine.open_session()
    try:
        await session.generate(chat(engine, "How is the weather?"), ANSWER)
        snap = await session.snapshot()
        assert snap.cuts == session.cuts and snap.cuts
        snap.to_file(tmp_path / "turn.agkv")
        read = KVSnapshot.from_file(tmp_path / "turn.agkv", expected_fingerprint=engine.fingerprint)
        assert read.cuts == snap.cuts
        restored = await engine.open_session()
        await restored.restore(read)
        assert restored.cuts == snap.cuts
        await restored.close()

        keys, values = snap.to_float()
        forms = [snap] + [KVSnapshot.from_float(snap.tokens, keys, values, precision=p, fingerprint=snap.fingerprint,
                                                cuts=snap.cuts) for p in ("f32", "bf16", "f16", "u8")]
        at = [0, snap.cuts[0], snap.cuts[-1], 32, snap.num_tokens // 2, snap.num_tokens]
        for form in forms:
            for a in at:
                joined = KVSnapshot.join([form.span(0, a), form.span(a, form.num_tokens)])
                assert joined.tokens == form.tokens and joined.cuts == form.cuts
                for name in ("keys", "values", "key_scale", "key_zero", "value_scale", "value_zero"):
                    x, y = getattr(joined, name), getattr(form, name)
                    assert (x is None and y is None) or (x.dtype == y.dtype and np.array_equal(x, y))
    finally:
        await session.close()


async def test_a_file_written_without_cuts_restores_with_cuts_unknown(engine, tmp_path):
    session = await engine.open_session()
    try:
        await session.prefill(chat(engine, "Any fog?"))
        old = dataclasses.replace(await session.snapshot(), cuts=None)  # what a file before cuts holds
        old.to_file(tmp_path / "old.agkv")
        await session.restore(KVSnapshot.from_file(tmp_path / "old.agkv"))
        assert session.cuts is None
        await session.generate(list(session.tokens) + engine.tokenizer.encode("\nMore?"), ANSWER)
        assert session.cuts is None  # KV computed on unknown KV is unknown too
        await session.trim(0)
        await session.prefill(chat(engine, "Any fog?"))
        assert session.cuts == tuple(canonical_starts(engine, chat(engine, "Any fog?")))
    finally:
        await session.close()
