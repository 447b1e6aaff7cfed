"""The CPU-plugin behaviours the exactness tests run under, whatever this machine's CPU is.

Machines differ: a CPU without avx512 computes in f32 with no dynamic quantisation; one with
avx512 quantises activations (group 32); one with avx512_bf16/AMX also computes in bf16. Each
profile asks the plugin for one behaviour. A profile this CPU ignores is skipped, saying why,
and so is one it computes bit for bit as a profile already run (``skip_if_computed_as_before``):
on an avx2 CPU all three are the same f32 kernels, so one run covers them::

    await skip_if_computed_as_before("dq32", __name__)
    engine = numerics_engine("dq32", num_slots=1)
"""

from __future__ import annotations

from typing import Any

import pytest

PROFILES: dict[str, dict[str, str]] = {
    "this-cpu": {},
    "dq32": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "32", "INFERENCE_PRECISION_HINT": "f32"},
    "dq0": {"DYNAMIC_QUANTIZATION_GROUP_SIZE": "0", "INFERENCE_PRECISION_HINT": "f32"},
}
"""this-cpu: the plugin's defaults here; dq32: an avx512 CPU without bf16 (dynamic quantisation
on); dq0: a CPU without avx512 (f32, no dynamic quantisation)."""

PROBE_PROMPT = "Name three rivers of Europe and say which one is the longest."
PROBE_TOKENS = 16
_signatures: dict[str, tuple[Any, ...]] = {}
"""profile → ``probe_signature`` of a stateful engine on it, probed once per process."""
_ran: set[tuple[str, str]] = set()
"""(scope, profile) of the profiles a test of that scope went on to run in this process."""


def skip_if_ignored(profile: str, engine: Any) -> None:
    """Skip when the plugin reports that it ignores the profile's dynamic-quantisation setting."""
    wanted = PROFILES[profile].get("DYNAMIC_QUANTIZATION_GROUP_SIZE")
    got = engine.numerics.dynamic_quantization_group_size
    if wanted is not None and int(wanted) != got:
        pytest.skip(f"this CPU ignores DYNAMIC_QUANTIZATION_GROUP_SIZE={wanted} (the plugin reports {got})")


def numerics_engine(profile: str, **options: Any):
    """A ``StatefulEngine`` with the profile's plugin settings; skips when the CPU ignores them."""
    from agentkv.engine.stateful.engine import StatefulEngine

    engine = StatefulEngine(ov_config=dict(PROFILES[profile]), **options)
    skip_if_ignored(profile, engine)
    return engine


async def probe_signature(engine: Any) -> tuple[Any, ...]:
    """What ``engine`` computes, to the bit: its KV cache precision and, for ``PROBE_TOKENS`` greedy
    tokens after a chat prompt, each token with its log-probability and its five likeliest rivals'.
    NOTE: not the plugin's reported dynamic quantisation: an avx2 CPU without VNNI reports group 32
    and runs every matmul as ``brgemm_avx2_f32`` all the same (measured, issue 27)."""
    from agentkv.engine.base import GenerationConfig

    tokenizer = engine.tokenizer
    ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": PROBE_PROMPT}],
                                                         add_generation_prompt=True))
    config = GenerationConfig(max_new_tokens=PROBE_TOKENS, ignore_eos=True, logprobs=5, prompt_lookup=False)
    session = await engine.open_session()
    try:
        deltas = [delta async for delta in session.stream(ids, config)]
    finally:
        await session.close()
    steps = tuple((d.token_id, d.logprob.logprob, tuple(t.logprob for t in d.logprob.top))
                  for d in deltas if d.logprob is not None)
    assert len(steps) == PROBE_TOKENS, "the probe reports every token's log-probability"
    return (engine.numerics.kv_cache, steps)


async def profile_signature(profile: str) -> tuple[Any, ...]:
    """``probe_signature`` of a one-slot stateful engine on ``profile`` (its compiled blob is cached:
    ~1 s), once per process: the plugin's kernels for those settings, whichever engine a test uses."""
    if profile not in _signatures:
        engine = numerics_engine(profile, num_slots=1, prefix_cache_bytes=0)
        try:
            _signatures[profile] = await probe_signature(engine)
        finally:
            await engine.aclose()
    return _signatures[profile]


async def skip_if_computed_as_before(profile: str, scope: str) -> None:
    """Skip ``profile``'s test when this CPU computes it bit for bit as a profile a test of the same
    ``scope`` (its module, say) already ran in this process: the same kernels, so that run covered
    this one. Call it before building the test's engine, which it then spares.

    Bit-identical log-probabilities over ``PROBE_TOKENS`` steps (prefill and decode, KV read back)
    cannot come from different kernels: dynamic quantisation or bf16 moves them by ~1e-2."""
    signature = await profile_signature(profile)
    for ran_scope, other in sorted(_ran):
        if ran_scope == scope and other != profile and _signatures[other] == signature:
            pytest.skip(f"this CPU computes profile {profile} bit for bit as {other} (kv={signature[0]}; "
                        f"{PROBE_TOKENS} probe tokens' log-probabilities equal): {other}'s run covers it")
    _ran.add((scope, profile))
