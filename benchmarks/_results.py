"""Benchmarks' results on disk: a run's last-line JSON saved with the machine, date and commit it was measured on.

Each benchmark script prints its last line with one call, which also saves it::

    print_result(__file__, figures)                   # prints json.dumps(figures), saves results/<script>.json
    print_result(__file__, figures, rows=rows)        # with a series the docs plot (turn by turn, ...)

``scripts/docs_figures.py`` reads these files and writes the docs' benchmark tables and plots, so
every figure in the docs says which CPU, date and commit it came from.

A run saves whenever the benchmark script is the program being run (``python benchmarks/x.py``),
with no flag to remember: a benchmark costs minutes of a machine, and a forgotten ``--save`` would
lose the run. A test that imports a script and calls its ``main`` (tests/test_window_benchmark.py
does, on a scripted engine) writes nothing. The files live in git: a throwaway run shows up in
``git status`` and is committed only when chosen; each file records the run's arguments too.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"
"""Where the saved runs live: one JSON file per benchmark (and variant), the latest run's."""

CPU_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")
"""The instruction sets that change the CPU plugin's numerics and speed (the docs' "Exactness" guide)."""

_STARTED = time.time()
_LOAD_AT_START = os.getloadavg()


def _cpu() -> tuple[str, list[str]]:
    """The CPU's model name and the flags of CPU_FLAGS_OF_INTEREST it has (Linux's /proc/cpuinfo)."""
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return model, [flag for flag in CPU_FLAGS_OF_INTEREST if flag in flags]


def _git_commit() -> tuple[str | None, bool]:
    """The repository's HEAD commit and whether the work tree had changes (None outside a checkout)."""
    root = RESULTS_DIR.parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip() != ""
    except (OSError, subprocess.CalledProcessError):
        return None, False
    return commit, dirty


def _openvino_version() -> str | None:
    """The installed openvino package's version, without importing it."""
    try:
        from importlib.metadata import version

        return version("openvino")
    except Exception:
        return None


_COMMIT_AT_START = _git_commit()
"""The code a run measures is the code it loaded when it started: its commit then, not at the end."""


def machine_record() -> dict[str, Any]:
    """What a figure needs to say about where and when it was measured: ``machine_record()["cpu"]``."""
    cpu, flags = _cpu()
    commit, dirty = _COMMIT_AT_START
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "cpu": cpu,
        "cpu_flags": flags,
        "cores": os.cpu_count(),
        "load_average_at_start": [round(load, 2) for load in _LOAD_AT_START],
        "load_average_at_end": [round(load, 2) for load in os.getloadavg()],
        "duration_s": round(time.time() - _STARTED, 1),
        "git_commit": commit,
        "git_dirty": dirty,
        "python": platform.python_version(),
        "openvino": _openvino_version(),
    }


def is_run_as_script(script: str) -> bool:
    """True when ``script`` (a benchmark's ``__file__``) is the program this process runs."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is not None and Path(main_file).resolve() == Path(script).resolve()


def save_result(script: str, figures: dict[str, Any], *, variant: str | None = None,
                **series: Any) -> Path | None:
    """Save a run's last-line ``figures`` (and any ``series``) to ``benchmarks/results/<name>.json``.

    ``save_result(__file__, {"x_over_y": 2.1}, rows=rows)``; ``variant`` names a second kind of run
    of one script (``snapshot.py --file-format`` -> ``snapshot_file_format.json``). Returns the path
    written, or None when the script is not the program being run (a test calling its ``main``).
    """
    if not is_run_as_script(script):
        return None
    name = Path(script).stem + (f"_{variant}" if variant else "")
    record = {"benchmark": name, "argv": sys.argv[1:], "measured": machine_record(), "figures": figures,
              "series": series}
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(record, indent=1, default=str) + "\n")
    temporary.replace(path)
    print(f"saved to {path}", file=sys.stderr)
    return path


def print_result(script: str, figures: dict[str, Any], *, variant: str | None = None, **series: Any) -> None:
    """Print a benchmark's last line (``json.dumps(figures)``) and save the run (see ``save_result``).

    ``print_result(__file__, {"x_over_y": 2.1}, rows=rows)``: the series go to the file only, the
    printed line stays the figures alone.
    """
    print(json.dumps(figures), flush=True)
    save_result(script, figures, variant=variant, **series)
