"""``agentkv models list`` / ``models prune`` over a temporary model cache holding fake conversions:
the default model's, older copies of it, ones whose GGUF is gone or changed, an interrupted one."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from agentkv.cli.app import app
from agentkv.engine.openvino.models import IR_FILES, SOURCE_FILE, gguf_ir_dir


def cli(*args: str, stdin: str | None = None):
    return CliRunner().invoke(app, ["models", *args], input=stdin, env={"COLUMNS": "200"})


def conversion(directory: Path, *, source: Path | None = None, megabytes: int = 1) -> Path:
    directory.mkdir(parents=True)
    for name in IR_FILES:
        (directory / name).write_text("ir", encoding="utf-8")
    (directory / "openvino_model.bin").write_bytes(b"\0" * megabytes * 1_000_000)
    if source is not None:
        (directory / SOURCE_FILE).write_text(json.dumps({"gguf": str(source)}), encoding="utf-8")
    return directory


@pytest.fixture
def cache(tmp_path, monkeypatch) -> dict[str, Path]:
    """A cache with every kind of conversion; the default GGUF and $AGENTKV_MODEL's are fakes."""
    monkeypatch.setenv("AGENTKV_CACHE_DIR", str(tmp_path / "cache"))
    gguf = {name: tmp_path / f"{name}.gguf" for name in ("Default.Q4", "Mine", "Kept", "Changed")}
    for path in gguf.values():
        path.write_bytes(b"GGUF")
    monkeypatch.setattr("agentkv.cli.model_cache.default_gguf_path", lambda: gguf["Default.Q4"])
    monkeypatch.setenv("AGENTKV_MODEL", str(gguf["Mine"]))
    models = tmp_path / "cache" / "models"
    dirs = {
        "default": conversion(gguf_ir_dir(gguf["Default.Q4"]), source=gguf["Default.Q4"]),
        "mine": conversion(gguf_ir_dir(gguf["Mine"]), source=gguf["Mine"]),
        "kept": conversion(gguf_ir_dir(gguf["Kept"]), source=gguf["Kept"]),
        "older": conversion(models / "Default.Q4-0123456789", megabytes=2),
        "gone": conversion(models / "Gone-aaaaaaaaaa", source=tmp_path / "Gone.gguf", megabytes=3),
        "changed": conversion(models / "Changed-bbbbbbbbbb", source=gguf["Changed"]),
        "interrupted": conversion(models / ".convert-old"),
        "running": conversion(models / ".convert-now"),
    }
    hours_ago = time.time() - 7200
    os.utime(dirs["interrupted"], (hours_ago, hours_ago))
    return dirs


def rows_of(output: str) -> dict[str, list[str]]:
    return {cells[1].strip(): [c.strip() for c in cells[2:5]] for cells in
            (line.split("│") for line in output.splitlines() if line.startswith("│"))}


def test_list_says_which_setting_uses_each_conversion_and_why_the_others_are_stale(cache):
    result = cli("list")
    assert result.exit_code == 0, result.output
    rows = rows_of(result.output)
    assert rows[cache["default"].name] == ["1", "default", ""]
    assert rows[cache["mine"].name] == ["1", "$AGENTKV_MODEL", ""]
    assert rows[cache["kept"].name] == ["1", "", ""]
    assert rows["Default.Q4-0123456789"] == ["2", "", "an older conversion of a model in use"]
    assert rows["Gone-aaaaaaaaaa"][2].startswith("its GGUF is gone")
    assert rows["Changed-bbbbbbbbbb"][2] == "its GGUF changed since (reinstalled or upgraded)"
    assert rows[".convert-old"][2] == "left by an interrupted conversion"
    assert ".convert-now" not in rows
    assert "4 stale, 7 MB: `agentkv models prune` removes them" in result.output


def test_prune_dry_run_lists_the_stale_and_removes_nothing(cache):
    result = cli("prune", "--dry-run")
    assert result.exit_code == 0, result.output
    assert set(rows_of(result.output)) == {"Default.Q4-0123456789", "Gone-aaaaaaaaaa", "Changed-bbbbbbbbbb",
                                           ".convert-old"}
    assert "would free 7 MB" in result.output
    assert all(path.is_dir() for path in cache.values())


def test_prune_asks_first_and_a_no_removes_nothing(cache):
    result = cli("prune", stdin="n\n")
    assert result.exit_code == 1, result.output
    assert "Remove these 4 conversions (7 MB)?" in result.output
    assert all(path.is_dir() for path in cache.values())


@pytest.mark.parametrize("args", [["--yes"], []], ids=["--yes", "confirmed"])
def test_prune_removes_only_the_stale_conversions(cache, args):
    result = cli("prune", *args, stdin=None if args else "y\n")
    assert result.exit_code == 0, result.output
    assert "removed 4 conversions, freed 7 MB" in result.output
    kept = {name for name, path in cache.items() if path.is_dir()}
    assert kept == {"default", "mine", "kept", "running"}
    again = cli("prune", "--yes")
    assert "nothing to prune" in again.output


def test_a_conversion_records_its_gguf_so_a_later_upgrade_makes_it_stale(fake_gguf_conversion):
    from agentkv.engine.openvino import models
    from agentkv.engine.openvino.model_cache import conversions

    gguf = fake_gguf_conversion()
    first = models._ensure_ir_for_gguf(gguf).ir_dir
    assert json.loads((first / SOURCE_FILE).read_text(encoding="utf-8")) == {"gguf": str(gguf.resolve())}
    gguf.write_bytes(b"GGUF v2")  # reinstalled: another size and time, another key
    second = models._ensure_ir_for_gguf(gguf).ir_dir
    found = {c.path: c.stale for c in conversions({second: "default"})}
    assert found == {first: "its GGUF changed since (reinstalled or upgraded)", second: ""}


def test_a_stale_conversion_that_cannot_be_removed_frees_nothing_and_stays_listed(cache, monkeypatch):
    import agentkv.engine.openvino.model_cache as model_cache

    monkeypatch.setattr(model_cache.shutil, "rmtree", lambda path, ignore_errors=False: None)  # e.g. in use
    result = cli("prune", "--yes")
    assert result.exit_code == 0, result.output
    assert "freed 0 MB" in result.output
    assert "nothing to prune" not in cli("prune", "--dry-run").output  # still there, still stale
