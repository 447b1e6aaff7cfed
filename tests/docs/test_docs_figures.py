"""scripts/docs_figures.py turns the benchmarks' saved runs into the pages' tables and plots, each saying
where and when it was measured, says "not measured" where no run was saved, and deletes plots no run made.

Marked ``docs`` (matplotlib is in the docs extra, not in make test's environment): ``make docs-test``.
The runs here are made up in a temporary directory; the real ones are benchmarks/results/*.json.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "docs_figures.py"
MEASURED = {"date": "2026-11-28T18:40:00Z", "cpu": "Example CPU 9000", "cpu_flags": ["avx2"], "cores": 2,
            "load_average_at_start": [1.5, 1.0, 1.0], "load_average_at_end": [2.5, 1.0, 1.0], "duration_s": 60.0,
            "git_commit": "0123456789abcdef", "git_dirty": False, "python": "3.11.7", "openvino": "2026.4.1"}


@pytest.fixture(scope="module")
def docs_figures():
    spec = importlib.util.spec_from_file_location("docs_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def save_run(results: Path, name: str, figures: dict, **series) -> None:
    results.mkdir(exist_ok=True)
    record = {"benchmark": name, "argv": ["--turns", "3"], "measured": MEASURED, "figures": figures, "series": series}
    (results / f"{name}.json").write_text(json.dumps(record), encoding="utf-8")


def page(pages: Path, name: str, *blocks: str) -> Path:
    pages.mkdir(exist_ok=True)
    path = pages / f"{name}.md"
    path.write_text(f"# {name}\n\nProse.\n\n" + "\n".join(f"<!-- figures: {b} -->\nold\n<!-- /figures: {b} -->\n"
                                                         for b in blocks), encoding="utf-8")
    return path


def test_a_saved_run_becomes_a_table_and_a_plot_that_name_the_machine_and_date(docs_figures, tmp_path):
    rows = [{"turn": t, "history_tokens": 150 * t, "agentkv_prefilled": 120, "agentkv_ttft": 0.2, "paged_ttft": 0.1,
             "stateless_ttft": 0.1 * t, "genai_chat_ttft": 0.2, "genai_default_ttft": 0.1} for t in range(1, 4)]
    save_run(tmp_path / "results", "multiturn", {"paged_over_genai_default_ttft": 0.93}, rows=rows)
    multiturn = page(tmp_path / "pages", "multiturn", "multiturn")
    summary = docs_figures.write_figures(tmp_path / "results", tmp_path / "pages", tmp_path / "figures")
    text = multiturn.read_text(encoding="utf-8")
    assert "old" not in text and text.startswith("# multiturn\n\nProse.")
    assert "| `paged_over_genai_default_ttft` | 0.93 |" in text
    assert "| 3 | 450 | 120 |" in text
    assert "Example CPU 9000 (avx2" in text and "2026-11-28 18:40:00 UTC" in text and "0123456789" in text
    assert "`python benchmarks/multiturn.py --turns 3`" in text
    assert "![multiturn ttft](../figures/multiturn-ttft.png)" in text
    assert (tmp_path / "figures" / "multiturn-ttft.png").stat().st_size > 10_000
    assert summary.startswith("docs_figures: 1 saved runs, 1 plots, 1 pages changed")


def test_a_benchmark_without_a_saved_run_says_it_was_not_measured_and_shows_no_number(docs_figures, tmp_path):
    (tmp_path / "results").mkdir()
    scaleout = page(tmp_path / "pages", "scaleout", "scaleout")
    index = page(tmp_path / "pages", "index", "headline")
    docs_figures.write_figures(tmp_path / "results", tmp_path / "pages", tmp_path / "figures")
    assert "Not measured for these pages" in scaleout.read_text(encoding="utf-8")
    assert "`python benchmarks/scaleout.py`" in scaleout.read_text(encoding="utf-8")
    headline = index.read_text(encoding="utf-8")
    assert "| [scaleout](scaleout.md) |" in headline and "| not measured | — |" in headline


def test_a_plot_no_saved_run_made_any_more_leaves_the_docs(docs_figures, tmp_path):
    (tmp_path / "figures").mkdir()
    superseded = tmp_path / "figures" / "old-figure.png"
    superseded.write_bytes(b"png")
    save_run(tmp_path / "results", "concurrency", {"batched_over_sequential_8": 2.9,
                                                   "tokens_per_s": {"1": 40.0, "8": 150.0}})
    page(tmp_path / "pages", "concurrency", "concurrency")
    summary = docs_figures.write_figures(tmp_path / "results", tmp_path / "pages", tmp_path / "figures")
    assert not superseded.exists()
    assert (tmp_path / "figures" / "concurrency-tokens-per-s.png").is_file()
    assert summary.endswith("1 superseded plots removed")
