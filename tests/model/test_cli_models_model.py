"""``agentkv models`` against real files: the default model's GGUF converted into an empty cache
(~5 s), and ``info --open`` compiling a zoo model to say which engine ``open_engine`` picks."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli.app import app
from agentkv.engine.openvino.models import IR_FILES

pytestmark = pytest.mark.model
ZOO = Path(__file__).parent.parent / "data" / "zoo"


def cli(*args: str):
    return CliRunner().invoke(app, ["models", *args], env={"COLUMNS": "80"})


def test_convert_the_default_gguf_into_an_empty_cache_then_list_and_info_it(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "cache"))
    converted = cli("convert", "--output", str(tmp_path / "out"))
    assert converted.exit_code == 0, converted.output
    assert all((tmp_path / "out" / name).is_file() for name in IR_FILES)
    listed = cli("list")
    assert listed.exit_code == 0, listed.output
    assert [line.split("│")[3].strip() for line in listed.output.splitlines() if line.startswith("│")] == ["default"]
    info = cli("info", str(tmp_path / "out"))
    assert info.exit_code == 0, info.output
    assert "GGUF llama" in info.output and "23,040 (f16" in info.output


def test_info_open_says_which_engine_open_engine_picks(monkeypatch):
    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    result = cli("info", str(ZOO / "qwen2_5"), "--open")
    assert result.exit_code == 0, result.output
    engine_line = next(line for line in result.output.splitlines() if line.strip().startswith("engine"))
    assert "PagedEngine" in engine_line
