"""The realistic-size model (issue 47): scripts/build_sized_model.py builds the Qwen2.5-1.5B shape, and
benchmarks' ``--model qwen2.5-1.5b-shape`` resolves to its built directory or names the command that
builds it. The fast tests build nothing (no torch here: the script's heavy imports are inside its build
functions); the slow one, in tests/model/test_sized_model_model.py, builds the model (~10 min, ~1 GB
in the user cache) or uses the built one and generates through agentkv."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from agentkv.errors import ModelNotFound

ROOT = Path(__file__).resolve().parents[1]
NAME = "qwen2.5-1.5b-shape"


def load(path: Path, name: str) -> ModuleType:
    """A script of the repository as a module (scripts/ and benchmarks/ are folders of scripts)."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def builder() -> ModuleType:
    return load(ROOT / "scripts" / "build_sized_model.py", "build_sized_model")


@pytest.fixture
def resolver(monkeypatch, tmp_path) -> ModuleType:
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path))
    return load(ROOT / "benchmarks" / "_sized_models.py", "_sized_models_under_test")


def test_the_builders_config_is_qwen2_5_1_5b_instructs_shape(builder):
    config = builder.SHAPES[NAME]["config"]
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (28, 1536, 8960)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (12, 2)
    assert config["hidden_size"] // config["num_attention_heads"] == 128  # head_dim
    assert config["vocab_size"] == 151936 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 1e6 and config["max_position_embeddings"] == 32768
    assert config["use_sliding_window"] is False and config["rms_norm_eps"] == 1e-6
    assert builder.EXPORT_ARGS == ["--weight-format", "int4", "--sym", "--group-size", "128", "--ratio", "1.0"]


def test_the_shape_has_qwen2_5_1_5bs_parameter_count_and_kv_bytes_per_token(builder):
    c = builder.SHAPES[NAME]["config"]
    hidden, kv = c["hidden_size"], c["num_key_value_heads"] * c["hidden_size"] // c["num_attention_heads"]
    attention = (hidden * hidden + hidden) + 2 * (hidden * kv + kv) + hidden * hidden  # q, k, v (biased), o
    layer = attention + 3 * hidden * c["intermediate_size"] + 2 * hidden
    parameters = c["vocab_size"] * hidden + c["num_hidden_layers"] * layer + hidden  # tied head
    assert parameters == 1_543_714_304  # Qwen2.5-1.5B's 1.54 B
    assert c["num_hidden_layers"] * 2 * kv * 2 == 28_672  # f16 K and V of one token, all layers


def test_the_tokenizer_layout_puts_qwens_special_tokens_at_their_real_ids(builder):
    spec = builder.SHAPES[NAME]
    ids = {token: spec["ordinary_tokens"] + index for index, (token, _) in enumerate(spec["specials"])}
    assert (ids["<|endoftext|>"], ids["<|im_start|>"], ids["<|im_end|>"]) == (151643, 151644, 151645)
    assert (ids["<tool_call>"], ids["</tool_call>"], ids["<|file_sep|>"]) == (151657, 151658, 151664)
    assert dict(spec["specials"])["<tool_call>"] is False  # an ordinary added token, as in Qwen's tokenizer
    assert len(spec["specials"]) + spec["ordinary_tokens"] == 151665 <= spec["config"]["vocab_size"]


def test_filler_pieces_are_distinct_deterministic_and_avoid_the_trained_vocabulary(builder):
    taken = {"\u0120the", "abc"}
    pieces = builder.filler_pieces(2000, taken)
    assert pieces == builder.filler_pieces(2000, taken)
    assert len(set(pieces)) == 2000 and not taken & set(pieces)
    assert all(piece.lstrip("\u0120").isalpha() and piece.lstrip("\u0120").islower() for piece in pieces)


def test_a_missing_model_is_model_not_found_naming_the_make_command(resolver, tmp_path):
    with pytest.raises(ModelNotFound, match=r"make sized-model SIZED_MODEL=qwen2\.5-1\.5b-shape") as caught:
        resolver.sized_model_dir(NAME, build=False)
    assert str(tmp_path / "models" / NAME) in str(caught.value)


def test_a_build_that_fails_is_model_not_found_naming_the_command(resolver, monkeypatch):
    monkeypatch.setattr(resolver, "build_command", lambda name: ["false"])
    with pytest.raises(ModelNotFound, match=r"exited 1.*make sized-model SIZED_MODEL=qwen2\.5-1\.5b-shape"):
        resolver.sized_model_dir(NAME)


def test_an_unknown_name_is_model_not_found_listing_the_known_ones(resolver):
    with pytest.raises(ModelNotFound, match="known: qwen2.5-1.5b-shape"):
        resolver.sized_model_dir("qwen9-shape", build=False)


def test_a_built_model_resolves_to_its_directory_and_other_values_pass_through(resolver, builder, tmp_path):
    target = tmp_path / "models" / NAME
    target.mkdir(parents=True)
    (target / builder.MANIFEST).write_text(json.dumps({"recipe": builder.recipe_hash(NAME)}), encoding="utf-8")
    assert resolver.sized_model_dir(NAME) == target
    assert resolver.model_arg(NAME) == str(target)
    assert resolver.model_arg("some/ir/dir") == "some/ir/dir" and resolver.model_arg(None) is None


def test_a_manifest_of_another_recipe_is_not_a_built_model(resolver, builder, tmp_path):
    target = tmp_path / "models" / NAME
    target.mkdir(parents=True)
    (target / builder.MANIFEST).write_text(json.dumps({"recipe": "an-older-recipe"}), encoding="utf-8")
    with pytest.raises(ModelNotFound, match="make sized-model"):
        resolver.sized_model_dir(NAME, build=False)
