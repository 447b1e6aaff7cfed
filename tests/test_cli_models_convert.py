"""A GGUF's conversion shows a progress bar naming the step it is on (openvino-genai faked)."""

from __future__ import annotations

import io
import re
from pathlib import Path

from rich.console import Console

from agentkv.engine.openvino import models


def test_conversion_shows_a_progress_bar_naming_each_step(fake_gguf_conversion, monkeypatch):
    seen: list[str] = []
    screen = io.StringIO()
    monkeypatch.setattr(models, "progress_console",
                        lambda: Console(file=screen, force_terminal=True, width=120, color_system=None))
    models._ensure_ir_for_gguf(fake_gguf_conversion(on_convert=lambda: seen.append(screen.getvalue())))
    shown = screen.getvalue()
    assert shown.startswith("Converting tiny.gguf to OpenVINO IR")
    for number, step in enumerate(models.CONVERT_STEPS):
        assert re.search(rf"{re.escape(step)} [ ━]+ {number}/{len(models.CONVERT_STEPS)} ", shown), step
    assert re.search(r"converting with openvino-genai ━{5,} +1/4 \S+$", seen[0])  # the bar, while it converts
    assert "4/4" in shown
    assert "Converted tiny.gguf in" in shown


def hf_dir(tmp_path: Path) -> Path:
    directory = tmp_path / "Tiny-hf"
    directory.mkdir()
    (directory / "config.json").write_text("{}", encoding="utf-8")
    return directory


def fake_optimum_cli(tmp_path: Path, monkeypatch, *, fails: bool) -> None:
    script = tmp_path / "optimum-cli"
    script.write_text("#!/bin/sh\necho 'Loading the model'\necho 'Exporting the tokenizer' >&2\n"
                      + ("echo 'ValueError: unsupported architecture' >&2\nexit 3\n" if fails else 'mkdir "$5"\n'),
                      encoding="utf-8")
    script.chmod(0o755)
    monkeypatch.setattr("agentkv.cli.models.importlib.util.find_spec", lambda name: object())
    monkeypatch.setattr("agentkv.cli.models.shutil.which", lambda name: str(script))


def test_converting_a_hugging_face_directory_shows_optimum_cli_s_steps(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentkv.cli.app import app

    screen = io.StringIO()
    monkeypatch.setattr(models, "progress_console",
                        lambda: Console(file=screen, force_terminal=True, width=120, color_system=None))
    fake_optimum_cli(tmp_path, monkeypatch, fails=False)
    result = CliRunner().invoke(app, ["models", "convert", str(hf_dir(tmp_path))])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "Tiny-hf-ov").is_dir()
    shown = screen.getvalue()
    assert shown.startswith("Converting Tiny-hf with optimum-intel")
    assert re.search(r"Loading the model ━+", shown) and re.search(r"Exporting the tokenizer ━+", shown)


def test_a_failed_hugging_face_conversion_says_optimum_cli_s_last_line(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from agentkv.cli.app import app

    fake_optimum_cli(tmp_path, monkeypatch, fails=True)
    result = CliRunner().invoke(app, ["models", "convert", str(hf_dir(tmp_path))])
    assert result.exit_code == 2, result.output
    assert "optimum-cli could not convert" in result.output
    assert "ValueError: unsupported architecture" in result.output
