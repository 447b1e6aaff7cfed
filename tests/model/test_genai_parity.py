"""Our decode loop against openvino-genai's LLMPipeline (SDPA) on the same prompt ids.

Both sides compile the same IR with the same plugin settings: the default engine settings (f16
KV, this CPU's numerics) for greedy decoding, and exact numerics for beam search — with dynamic
quantisation or bf16 compute, a batch of beams is computed differently from one row, so near-tie
beams could flip on one side only.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import numpy as np
import openvino as ov
import openvino_genai as og
import pytest

from agentkv.engine.base import GenerationConfig
from agentkv.engine.openvino.models import compiled_cache_dir
from agentkv.engine.openvino.numerics import EXACT_CONFIG

if TYPE_CHECKING:
    from agentkv.engine.openvino.engine import OpenVINOEngine

pytestmark = pytest.mark.model

PROMPTS = [
    "Write a short poem about the sea.",
    "Explain photosynthesis to a child.",
    "What is the capital of Japan? Answer in one sentence.",
]
"""Three prompts: two open answers and one that ends early (beams that finish before the
others). Each is a whole decode compared token by token; more prompts would repeat the same
check on other text."""


@pytest.fixture(scope="module")
def engine(engine_plain):
    """LLMPipeline has no prefix cache: compare against an engine without one."""
    return engine_plain


def llm_pipeline(engine: OpenVINOEngine, **config: str) -> og.LLMPipeline:
    """LLMPipeline (SDPA) on ``engine``'s IR. NOTE: with our compiled-model cache, as the engines
    have (when it can be written): a later start loads the compiled blob (~1.7 s) instead of
    compiling (~5.6 s); the blob is the model compiled with the same settings, so the numerics
    are the same."""
    cache = compiled_cache_dir()
    if os.access(cache, os.W_OK):
        config = {"CACHE_DIR": str(cache), **config}
    return og.LLMPipeline(str(engine.files.ir_dir), "CPU", ATTENTION_BACKEND="SDPA", **config)


@pytest.fixture(scope="module")
def pipeline(engine_plain):
    return llm_pipeline(engine_plain, KV_CACHE_PRECISION=engine_plain.kv_cache_precision)


@pytest.fixture(scope="module")
def exact_pair(engine_f32):
    """An exact-numerics engine and LLMPipeline compiled with the same settings. The engine is
    the session's ``engine_f32`` (exact, no prefix cache), not one more compile of its own."""
    return engine_f32, llm_pipeline(engine_f32, **EXACT_CONFIG)


def genai_generate(pipeline, ids: list[int], **options) -> list[list[int]]:
    cfg = og.GenerationConfig()
    for key, value in options.items():
        setattr(cfg, key, value)
    inputs = og.TokenizedInputs(
        ov.Tensor(np.array([ids], dtype=np.int64)), ov.Tensor(np.ones((1, len(ids)), dtype=np.int64))
    )
    return [list(t) for t in pipeline.generate(inputs, cfg).tokens]


def agreed_prefix(a, b) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


async def test_greedy_tokens_equal_llmpipeline_for_32_tokens(engine, pipeline, chat_ids):
    for question in PROMPTS:
        ids = chat_ids(question)
        session = await engine.open_session()
        ours = (await session.generate(ids, GenerationConfig(max_new_tokens=32, ignore_eos=True))).token_ids
        await session.close()
        theirs = genai_generate(pipeline, ids, max_new_tokens=32, ignore_eos=True)[0]
        assert list(ours) == theirs, question


async def test_beam_search_agrees_with_llmpipeline_num_beams_4(exact_pair, chat_ids):
    engine, pipeline = exact_pair
    agreement = []
    for question in PROMPTS:
        ids = chat_ids(question)
        session = await engine.open_session()
        result = await session.generate(ids, GenerationConfig(max_new_tokens=24, num_beams=4))
        await session.close()
        theirs = genai_generate(pipeline, ids, max_new_tokens=24, num_beams=4, num_return_sequences=1)[0]
        ours = list(result.token_ids)
        agreement.append(agreed_prefix(ours, theirs) / max(1, len(theirs)))
    # Beam search is exact arithmetic on the same logits: expect identical winners.
    assert np.mean(agreement) >= 0.9, agreement
