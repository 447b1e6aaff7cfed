"""open_engine: the paged engine by default on CPU, the stateful one when asked, on NPU, or when
the model has no paged form; clear errors for a backend that does not exist.

The tests here run the real model; the scripted ones are in ``tests/test_engine_factory.py``."""

from __future__ import annotations

import logging

import pytest
from zoo_helpers import ZOO

from agentkv import UserError, open_engine

pytestmark = pytest.mark.model


def test_the_default_on_cpu_is_the_paged_engine_and_stateful_is_one_word_away(monkeypatch):
    """Which backend is picked and which options reach it is routing, not numerics: on the zoo's
    tiny Qwen2.5 (the default model's paged graph took ~6.5 CPU-s to compile here, the zoo's ~1)."""
    from agentkv.engine.paged.engine import PagedEngine
    from agentkv.engine.stateful.engine import StatefulEngine

    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    paged = open_engine(ZOO / "qwen2_5", num_slots=1, kv_cache_bytes=16 << 20, chunk_graph=False)
    assert isinstance(paged, PagedEngine) and paged.fingerprint.endswith(":paged")
    assert paged.paged_model.graphs == 1
    # the paged-only options are dropped
    stateful = open_engine(ZOO / "qwen2_5", backend="stateful", num_slots=1, kv_cache_bytes=16 << 20,
                           chunk_graph=True, small_graph=True)
    assert type(stateful) is StatefulEngine and not stateful.fingerprint.endswith(":paged")


async def test_small_graph_false_opens_the_paged_engine_on_two_graphs_where_drafts_still_verify(monkeypatch):
    from agentkv.engine.base import GenerationConfig

    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    paged = open_engine(num_slots=1, kv_cache_bytes=16 << 20, small_graph=False)
    try:
        assert paged.paged_model.wait_for_graphs() == 2
        session = await paged.open_session()
        doc = ("The root cause was a connection pool limit of 64 on the gateway client, set in release 2.31.0, "
               "which was too low for the overnight batch of subscription renewals.")
        messages = [{"role": "user", "content": "Find the incident report."},
                    {"role": "assistant", "content": "The search tool returned this document:\n\n" + doc},
                    {"role": "user", "content": "Quote the root cause exactly as written."}]
        ids = paged.tokenizer.encode(paged.tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        result = await session.generate(ids, GenerationConfig(max_new_tokens=32))
        assert result.metrics.drafted_tokens > 0 and result.metrics.accepted_tokens > 0  # verified on the chunk graph
        await session.close()
    finally:
        await paged.aclose()


def test_a_model_without_a_paged_form_falls_back_to_the_stateful_engine_with_a_warning(monkeypatch, caplog):
    import agentkv.engine.paged.engine as paged_module
    from agentkv.engine.stateful.engine import StatefulEngine

    def no_paged_form(*args, **kwargs):
        raise RuntimeError("paged_attention_transformation: unsupported attention pattern")

    monkeypatch.setattr(paged_module, "PagedEngine", no_paged_form)
    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.factory"):
        engine = open_engine(num_slots=1)
    assert type(engine) is StatefulEngine
    assert "unsupported attention pattern" in caplog.text and "stateful" in caplog.text


def test_an_npu_gets_the_stateful_engine(monkeypatch):
    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    with pytest.raises(UserError, match="could not compile the model for device 'NPU'"):
        open_engine(device="NPU", num_slots=1)  # this machine has none: the stateful engine says so
