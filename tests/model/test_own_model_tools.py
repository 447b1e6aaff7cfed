"""Users' own IRs with tools and stop tokens (issue 25 items 1, 2 and 6), on every zoo family.

The zoo's directories (tests/data/zoo) are what optimum-intel exports: no GGUF, a ``tokenizer.json``
and a ``generation_config.json``. Through the public API an agent with a ``@tool`` and
``tool_choice="required"`` runs on each: the grammar, built from ``tokenizer.json``, forces a
call that parses into a schema-valid ``ToolCall`` (the weights are random: the structure comes
from the grammar, the enum and the boolean keep it short), and the run goes on to the tool
result. Stop tokens: the engine's EOS set holds ``generation_config.json``'s ids, and a
generation whose only allowed token is one of them stops there (``finish_reason == "stop"``).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
from zoo_helpers import exact_zoo_engine

from agentkv import Agent, GenerationConfig, Runtime, open_engine, tool
from agentkv.engine.openvino.models import ModelFiles
from agentkv.errors import ConstraintError

pytestmark = pytest.mark.model

ZOO = Path(__file__).resolve().parent.parent / "data" / "zoo"
FAMILIES = sorted(p.name for p in ZOO.iterdir() if (p / "reference.json").is_file()) if ZOO.is_dir() else []


@tool
def forecast(city: Literal["Paris", "Rome"], tomorrow: bool) -> str:
    """The weather in a city.

    Args:
        city: The city.
        tomorrow: Tomorrow's weather rather than today's.
    """
    return f"sunny in {city}"


def _engine(family: str) -> Any:
    """One engine per family (exact numerics, no prefix cache, one slot), shared with test_tool_formats_model."""
    return exact_zoo_engine(family, num_slots=1)


def _generation_eos(family: str) -> list[int]:
    value = json.loads((ZOO / family / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"]
    return [value] if isinstance(value, int) else list(value)


class _OnlyToken:
    """A token constraint that allows one id at every step (``TokenConstraint``)."""

    def __init__(self, token_id: int, vocab_size: int) -> None:
        self._mask = np.zeros(vocab_size, dtype=np.bool_)
        self._mask[token_id] = True

    def allowed_mask(self) -> np.ndarray:
        return self._mask

    def advance(self, token_id: int) -> None:
        assert self._mask[token_id]

    def is_finished(self) -> bool:
        return False


def test_every_zoo_directory_is_a_users_ir_without_a_gguf() -> None:
    assert set(FAMILIES) >= {"qwen2_5", "qwen3", "llama3_1", "phi3_5", "gemma2", "gemma3", "mistral_nemo"}
    for family in FAMILIES:
        assert not list((ZOO / family).glob("*.gguf")) and (ZOO / family / "tokenizer.json").is_file()


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_required_tool_call_parses_runs_and_the_run_goes_on(family: str) -> None:
    agent = Agent(name="weather", instructions="Use the forecast tool.", tools=[forecast],
                  tool_choice="required", max_model_calls=3, generation=GenerationConfig(max_new_tokens=40))
    runtime = Runtime(_engine(family))
    try:
        conversation = await runtime.open_conversation(agent)
        result = await runtime.run(conversation, "What is the weather in Paris?")
    finally:
        await runtime.aclose()
    assert len(result.tool_calls) == 1, result
    call = result.tool_calls[0]
    assert call.name == "forecast"
    assert set(call.arguments) == {"city", "tomorrow"}
    assert call.arguments["city"] in {"Paris", "Rome"} and isinstance(call.arguments["tomorrow"], bool)
    tool_results = [m for m in result.new_messages if m.role == "tool"]
    assert [m.content for m in tool_results] == [f"sunny in {call.arguments['city']}"]
    # the run went on: a model call after the tool's result (a call cut by max_new_tokens is
    # retried with room first, so there may be more than two)
    roles = [m.role for m in result.new_messages]
    assert roles.index("tool") < len(roles) - 1 and roles[-1] == "assistant"


@pytest.mark.parametrize("family", FAMILIES)
def test_eos_set_holds_the_tokenizers_eos_and_generation_configs_ids(family: str) -> None:
    engine = _engine(family)
    assert engine.tokenizer.eos_token_id in engine.eos_token_ids
    assert set(_generation_eos(family)) <= engine.eos_token_ids
    assert engine.eos_token_ids == {engine.tokenizer.eos_token_id, *_generation_eos(family)}


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_generation_stops_on_each_generation_config_eos(family: str) -> None:
    engine = _engine(family)
    vocab_size = int(json.loads((ZOO / family / "config.json").read_text(encoding="utf-8"))["vocab_size"])
    prompt = json.loads((ZOO / family / "reference.json").read_text(encoding="utf-8"))["prompt_ids"]
    not_eos = next(i for i in range(10, vocab_size) if i not in engine.eos_token_ids)
    session = await engine.open_session()
    try:
        for eos in _generation_eos(family):
            result = await session.generate(prompt, GenerationConfig(max_new_tokens=3),
                                            constraint=_OnlyToken(eos, vocab_size))
            assert (result.finish_reason, list(result.token_ids)) == ("stop", [eos]), (family, eos)
        result = await session.generate(prompt, GenerationConfig(max_new_tokens=3),
                                        constraint=_OnlyToken(not_eos, vocab_size))
        assert (result.finish_reason, list(result.token_ids)) == ("length", [not_eos] * 3)
    finally:
        await session.close()


def test_generation_config_eos_may_be_an_int_or_a_list_or_absent(tmp_path: Path) -> None:
    files = ModelFiles(ir_dir=tmp_path, gguf_path=None)
    assert files.generation_eos_ids() == [] and files.tokenizer_json() is None
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 106}', encoding="utf-8")
    assert files.generation_eos_ids() == [106]
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [1, 106]}', encoding="utf-8")
    assert files.generation_eos_ids() == [1, 106]
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 2}', encoding="utf-8")
    assert files.generation_eos_ids() == []


def test_without_tokenizer_json_or_gguf_the_error_names_what_is_missing(tmp_path: Path) -> None:
    ir = tmp_path / "ir"
    shutil.copytree(ZOO / "qwen2_5", ir, ignore=shutil.ignore_patterns("tokenizer.json"))
    engine = open_engine(ir, num_slots=1, prefix_cache_bytes=0, kv_cache_bytes=4 << 20)
    with pytest.raises(ConstraintError, match="neither tokenizer.json nor a .gguf"):
        engine.make_constraint('start: "x"')
