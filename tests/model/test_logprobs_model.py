"""Log-probabilities on the default model: each greedy token is its own most likely alternative,
and its log-probability is the log-softmax of the engine's next-token logits at its position."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.engine.base import GenerationConfig
from _sessions import one_pass_logits

pytestmark = pytest.mark.model

STEPS = 4
TOP = 5


def reference_log_softmax(logits: np.ndarray) -> np.ndarray:
    """log p = x - logsumexp(x), in float64."""
    x = np.asarray(logits, dtype=np.float64)
    return x - (x.max() + np.log(np.exp(x - x.max()).sum()))


async def test_greedy_tokens_are_their_top_alternative_with_the_logprob_of_the_next_token_logits(any_exact_engine):
    # NOTE: exact numerics: with the default ones (bf16, dynamic quantisation) a one-pass prefill
    # moves the top tokens' log-probabilities by up to ~0.25 from the one-token-a-step path, too
    # much for a one-pass reference to check anything
    engine = any_exact_engine
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
    session = await engine.open_session()
    config = GenerationConfig(max_new_tokens=STEPS, ignore_eos=True, logprobs=TOP)
    deltas = [d async for d in session.stream(prompt, config) if d.logprob is not None]
    await session.close()
    assert len(deltas) == STEPS
    # noise of the engine's logits on this machine: the decode path (one token per step) against
    # a one-pass prefill of the same tokens, at each position, over the alternatives compared
    incremental = await engine.open_session()
    await incremental.prefill(prompt)
    noise, scale, references = 0.0, 0.0, []
    for step, delta in enumerate(deltas):
        tokens = prompt + [d.token_id for d in deltas[:step]]
        await incremental.prefill(tokens)
        stepped = reference_log_softmax(await incremental.next_token_logits())
        logits = await one_pass_logits(engine, tokens)
        reference = reference_log_softmax(logits)
        compared = [t.token_id for t in delta.logprob.top]
        noise = max(noise, float(np.abs(stepped[compared] - reference[compared]).max()))
        scale = max(scale, float(np.abs(logits).max()))
        references.append(reference)
    await incremental.close()
    # float32 log-softmax rounding on top of the measured noise
    tolerance = 2 * noise + 8 * float(np.finfo(np.float32).eps) * scale
    for delta, reference in zip(deltas, references):
        lp = delta.logprob
        assert lp.token_id == delta.token_id and lp.top[0].token_id == delta.token_id  # greedy: the top-1
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        assert abs(lp.logprob - reference[delta.token_id]) <= tolerance, (lp.logprob, reference[delta.token_id])
        for alternative in lp.top:
            assert abs(alternative.logprob - reference[alternative.token_id]) <= tolerance
        assert lp.token == engine.tokenizer.decode([delta.token_id])
    print(f"logprob noise on this machine: {noise:.2e}, tolerance {tolerance:.2e}")
