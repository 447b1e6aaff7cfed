"""The KV invariant on the real model: after any sequence of operations, the session's
next-token logits equal a one-pass prefill of ``session.tokens``.

Exact numerics (``exact=True``: f32 KV, f32 compute, no dynamic quantisation): within 1e-3, on
any CPU. The default settings (f16 KV, this CPU's numerics — bf16 compute and dynamic
quantisation on some CPUs): within the difference chunked prefill alone causes, measured in
the same case, and argmax agrees on a high fraction of cases.

Each property runs ``CASES`` derandomized cases (the same on every run): between them they run
all seven operations, up to five chained in one session.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentkv.engine.base import GenerationConfig

pytestmark = pytest.mark.model

token = st.integers(min_value=200, max_value=40000)
new_ids = st.lists(token, min_size=1, max_size=24)
operation = st.one_of(
    st.tuples(st.just("generate"), new_ids, st.integers(1, 8)),
    st.tuples(st.just("diverge"), st.integers(1, 16), new_ids, st.integers(1, 6)),
    st.tuples(st.just("trim"), st.floats(0.0, 1.0)),
    st.tuples(st.just("fork")),
    st.tuples(st.just("snapshot_restore")),
    st.tuples(st.just("cancel"), new_ids, st.integers(1, 5)),
    st.tuples(st.just("beam"), new_ids, st.integers(2, 3), st.integers(2, 6)),
)
operations = st.lists(operation, min_size=1, max_size=5)
SEED = [1, 4093, 198, 19556, 28, 638, 359, 346, 47, 2, 198, 1, 520, 9531, 198]
CASES = 6
"""Cases per property. At 6, each test's cases run every operation kind (hypothesis sizes its cases
by ``max_examples``: the 10 the default-settings test ran before never forked, the 12 of the exact
test repeated single operations)."""


async def apply(engine, session, op):
    """Run one operation; returns the session to continue with (fork switches to the child)."""
    kind = op[0]
    if kind == "generate":
        await session.generate(list(session.tokens) + op[1], GenerationConfig(max_new_tokens=op[2]))
    elif kind == "diverge":
        keep = max(1, len(session.tokens) - op[1])
        await session.generate(list(session.tokens[:keep]) + op[2], GenerationConfig(max_new_tokens=op[3]))
    elif kind == "trim":
        await session.trim(max(1, int(len(session.tokens) * op[1])))
    elif kind == "fork":
        child = await session.fork()
        await session.close()
        return child
    elif kind == "snapshot_restore":
        snap = await session.snapshot()
        await session.generate(list(session.tokens) + [300, 301], GenerationConfig(max_new_tokens=2))
        await session.restore(snap)
    elif kind == "cancel":
        prompt = list(session.tokens) + op[1]
        with anyio.CancelScope() as scope:
            seen = 0
            async for _ in session.stream(prompt, GenerationConfig(max_new_tokens=32, ignore_eos=True)):
                seen += 1
                if seen == op[2]:
                    scope.cancel()
    elif kind == "beam":
        cfg = GenerationConfig(max_new_tokens=op[3], num_beams=op[2], ignore_eos=True)
        await session.generate(list(session.tokens) + op[1], cfg)
    return session


async def run_case(engine, ops) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
    session = await engine.open_session()
    await session.prefill(SEED)
    for op in ops:
        session = await apply(engine, session, op)
        await session.check_integrity()
    logits = await session.next_token_logits()
    tokens = session.tokens
    await session.close()
    fresh = await engine.open_session()
    await fresh.prefill(tokens)  # one pass
    reference = await fresh.next_token_logits()
    await fresh.close()
    return logits, reference, tokens


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=operations)
def test_invariant_holds_with_exact_numerics_after_any_operations(engine_f32, ops):
    logits, reference, tokens = anyio.run(run_case, engine_f32, ops)
    assert np.abs(logits - reference).max() <= 1e-3, (ops, len(tokens))


async def chunking_difference(engine, tokens: tuple[int, ...]) -> float:
    """Max abs logit difference between a one-pass prefill and prompt + token-by-token feeding."""
    one = await engine.open_session()
    await one.prefill(tokens)
    a = await one.next_token_logits()
    await one.close()
    chunked = await engine.open_session()
    split = max(1, len(tokens) // 2)
    await chunked.prefill(tokens[:split])
    for i in range(split + 1, len(tokens) + 1):
        await chunked.prefill(tokens[:i])
    b = await chunked.next_token_logits()
    await chunked.close()
    return float(np.abs(a - b).max())


DEFAULT_RESULTS: list[tuple[float, bool]] = []


@settings(max_examples=CASES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(ops=operations)
def test_invariant_holds_with_default_settings_within_the_chunking_difference(engine_plain, ops):
    logits, reference, tokens = anyio.run(run_case, engine_plain, ops)
    chunking = anyio.run(chunking_difference, engine_plain, tokens)
    diff = float(np.abs(logits - reference).max())
    DEFAULT_RESULTS.append((diff, int(logits.argmax()) == int(reference.argmax())))
    # Chunking noise measured on this very log; 2× + a floor for the operations' own cuts.
    assert diff <= max(2 * chunking, 0.25), (ops, diff, chunking)


def test_default_settings_argmax_agrees_on_most_invariant_cases():
    if not DEFAULT_RESULTS:
        pytest.skip("runs after the default-settings invariant test")
    agree = sum(ok for _, ok in DEFAULT_RESULTS) / len(DEFAULT_RESULTS)
    assert agree >= 0.8, DEFAULT_RESULTS
