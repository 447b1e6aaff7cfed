"""``agentkv models``: ``info`` over the zoo's model directories (read, never compiled), ``list``
over a temporary model cache, and every bad input as one line with exit code 2 (issue 25)."""

from __future__ import annotations

import json
import shutil
from functools import cache
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli.app import app

ZOO = Path(__file__).parent / "data" / "zoo"
FAMILIES = {"gemma2": "gemma2", "gemma3": "gemma3_text", "llama3_1": "llama", "mistral_nemo": "mistral",
            "phi3_5": "phi3", "qwen2_5": "qwen2", "qwen3": "qwen3"}


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path, monkeypatch) -> Path:
    """Converted models go to (and are listed from) a temporary cache, never the user's."""
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cli(*args: str):
    return CliRunner().invoke(app, ["models", *args], env={"COLUMNS": "80"})


def lines_of(output: str) -> dict[str, str]:
    """``info``'s rows as {label: value}, folded lines joined."""
    rows: dict[str, str] = {}
    label = ""
    for line in output.splitlines()[1:]:
        head, _, value = line.strip().partition("  ")
        if line.startswith(" ") and not line.startswith("  ") and value:
            label = head
            rows[label] = value.strip()
        elif label:
            rows[label] += " " + line.strip()
    return rows


@cache
def info_of(name: str) -> tuple[int, str]:
    """``models info`` of a zoo directory, run once per directory (it compiles the tokenizer IRs)."""
    result = cli("info", str(ZOO / name))
    return result.exit_code, result.output


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_info_reads_each_zoo_family_without_compiling_the_model(family):
    exit_code, output = info_of(family)
    assert exit_code == 0, output
    assert max(map(len, output.splitlines())) <= 80
    rows = lines_of(output)
    config = json.loads((ZOO / family / "config.json").read_text(encoding="utf-8"))
    eos = json.loads((ZOO / family / "generation_config.json").read_text(encoding="utf-8"))["eos_token_id"]
    assert rows["family"].startswith(FAMILIES[family] + " (")
    assert rows["eos ids"] == ", ".join(map(str, eos if isinstance(eos, list) else [eos]))
    assert rows["context length"] == str(config["max_position_embeddings"])
    kv_bytes = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 2
    assert rows["KV bytes/token"].startswith(f"{kv_bytes:,} (f16")
    assert "--open" in rows["engine"]


def test_info_shows_partial_rotary_sliding_window_softcap_and_tool_formats():
    rows = {family: lines_of(info_of(family)[1]) for family in FAMILIES}
    assert rows["phi3_5"]["rope"] == "θ 10000.0, partial rotary 0.75"
    assert "sliding window 32" in rows["gemma2"]["attention"]
    assert "logit softcap" in rows["gemma2"]["attention"]
    assert rows["gemma3"]["rope"] == "θ 1000000.0, local θ 10000.0"
    assert rows["llama3_1"]["rope"] == "θ 500000.0, scaling llama3"
    assert rows["qwen2_5"]["tool format"].startswith("hermes")
    assert rows["mistral_nemo"]["tool format"].startswith("mistral")
    assert rows["llama3_1"]["tool format"].startswith("llama3")
    assert rows["qwen3"]["template"] == "takes tools=, thinking (<think>)"
    gemma2_format = rows["gemma2"]["tool format"]
    assert gemma2_format.startswith("hermes") and "the template names none" in gemma2_format


@pytest.mark.parametrize(("compute", "kv"), [("f32", "f16"), ("bf16", "bf16")])
def test_info_gives_kv_bytes_at_the_precision_the_paged_engine_picks_on_this_cpu(compute, kv, monkeypatch):
    """f16 KV is typed bf16 where the plugin computes in bf16 (PagedModel's choice): same bytes,
    the name the engine's numerics will report."""
    monkeypatch.setattr("agentkv.engine.paged.block_precision.compute_precision", lambda *args: compute)
    rows = lines_of(cli("info", str(ZOO / "qwen2_5")).output)
    assert rows["KV bytes/token"] == f"256 ({kv}: the paged engine's KV precision on this CPU)"


def test_info_reads_the_template_where_the_runtime_does_in_the_transformers_4_57_layout():
    """optimum-intel with transformers 4.57 writes chat_template.jinja (and the tokenizer IR's
    rt_info), no template in tokenizer_config.json: Mistral Nemo must still read as Mistral."""
    from agentkv.cli.models import describe
    from agentkv.engine.openvino.tokenizer import OVTokenizer

    new = ZOO / "mistral_nemo_jinja"
    assert "chat_template" not in json.loads((new / "tokenizer_config.json").read_text(encoding="utf-8"))
    exit_code, output = info_of("mistral_nemo_jinja")
    assert exit_code == 0, output
    rows, old_rows = lines_of(output), lines_of(info_of("mistral_nemo")[1])
    assert rows["tool format"].startswith("mistral: [TOOL_CALLS]")
    assert "the fallback" not in rows["tool format"] and rows["template"].startswith("takes tools=")
    assert {k: v for k, v in rows.items() if k != "files"} == {k: v for k, v in old_rows.items() if k != "files"}
    assert describe(new).template == OVTokenizer(new).chat_template


def test_info_of_a_hugging_face_directory_reads_chat_template_jinja(tmp_path):
    directory = tmp_path / "Nemo-hf"
    directory.mkdir()
    for name in ("config.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ZOO / "mistral_nemo_jinja" / name, directory)
    rows = lines_of(cli("info", str(directory)).output)
    assert rows["template"].startswith("takes tools=")
    assert "chat_template.jinja" in rows["files"]


def test_list_shows_the_cached_models_their_size_and_the_default(isolated_cache, tmp_path, monkeypatch):
    gguf = tmp_path / "Default.Q4.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setattr("agentkv.cli.model_cache.default_gguf_path", lambda: gguf)
    empty = cli("list")
    assert empty.exit_code == 0, empty.output
    assert "not converted yet" in empty.output
    from agentkv.engine.openvino.models import gguf_ir_dir

    default = gguf_ir_dir(gguf)
    other = isolated_cache / "models" / "Other-0123456789"
    for directory in (default, other):
        directory.mkdir(parents=True)
    (other / "openvino_model.bin").write_bytes(b"\0" * 3_000_000)
    result = cli("list")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[2:4] for line in result.output.splitlines()
            if line.startswith("│")}
    assert [cell.strip() for cell in rows[default.name]] == ["0", "default"]
    assert [cell.strip() for cell in rows[other.name]] == ["3", ""]
    assert "not converted yet" not in result.output


def bad_config(tmp_path: Path) -> Path:
    directory = tmp_path / "broken"
    shutil.copytree(ZOO / "qwen2_5", directory, ignore=shutil.ignore_patterns("*.bin", "*.xml"))
    (directory / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    return directory


def hf_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "Qwen-hf"
    directory.mkdir()
    shutil.copy(ZOO / "qwen2_5" / "config.json", directory)
    return directory


@pytest.mark.parametrize(("args", "says"), [
    (lambda tmp: ["info", str(tmp / "missing")], "no model at"),
    (lambda tmp: ["info", str(tmp)], "is not a model directory (no config.json, no .gguf)"),
    (lambda tmp: ["info", str(bad_config(tmp))], "cannot read"),
    (lambda tmp: ["convert", str(tmp / "missing.gguf")], "no .gguf file or model directory at"),
    (lambda tmp: ["convert", str(tmp)], "is not a model directory (no config.json)"),
    (lambda tmp: ["convert", str(ZOO / "qwen3")], "is already an OpenVINO IR"),
    (lambda tmp: ["convert", str(hf_dir(tmp))],
     "needs optimum-intel, which agentkv does not install: pip install 'optimum[openvino]'"),
    (lambda tmp: ["convert", "--output", str(tmp)], "already exists"),
])
def test_every_bad_input_is_one_line_exit_2_and_no_traceback(args, says, tmp_path, monkeypatch):
    monkeypatch.setattr("agentkv.cli.models.importlib.util.find_spec", lambda name: None)
    result = cli(*args(tmp_path))
    assert result.exit_code == 2, result.output
    assert isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert says in result.output
