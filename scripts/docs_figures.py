"""Writes the docs' benchmark tables and plots from the benchmarks' saved runs (benchmarks/results/*.json).

    python scripts/docs_figures.py          # or: make docs-figures (needs the docs extra: matplotlib)

Each benchmark page (docs/benchmarks/*.md) is prose written by hand with generated blocks in it::

    <!-- figures: multiturn -->
    ...written here from benchmarks/results/multiturn.json...
    <!-- /figures: multiturn -->

A block is replaced by the run's table (and plot, docs/figures/benchmarks/*.png), each saying the CPU,
the date, the commit and the load it was measured under; a block whose result file is missing says
the benchmark was not measured for these pages and how to measure it — no figure is made up. Plots
this run did not write are deleted (a superseded figure leaves the docs; git keeps it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen before pyplot loads)

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PAGES = ROOT / "docs" / "benchmarks"
FIGURES = ROOT / "docs" / "figures" / "benchmarks"
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w-]+) -->\n).*?(<!-- /figures: (?P=name) -->)", re.S)

Record = dict[str, Any]


def measured_on(record: Record) -> str:
    """One sentence naming where and when a run was measured: the caption under every table and plot."""
    m = record["measured"]
    flags = ", ".join(m.get("cpu_flags") or []) or "no avx2"
    commit = (m.get("git_commit") or "?")[:10] + (" with uncommitted changes" if m.get("git_dirty") else "")
    start, end = (m.get("load_average_at_start") or [None])[0], (m.get("load_average_at_end") or ["?"])[0]
    load = f"{start} at the start and {end} at the end" if start is not None else f"{end} at the end"
    command = " ".join([f"python benchmarks/{script_of(record)}.py", *(record.get("argv") or [])])
    return (f"Measured {m['date'].replace('T', ' ').rstrip('Z')} UTC on {m['cpu']} ({flags}; {m['cores']} cores "
            f"shared with other jobs, load average {load}, so timings carry that noise), "
            f"openvino {m.get('openvino')}, commit {commit}: `{command}`, in {m.get('duration_s', '?')} s.")


def script_of(record: Record) -> str:
    """The benchmark script a result came from (``snapshot_file_format`` -> ``snapshot``)."""
    return script_named(record["benchmark"])


def script_named(name: str) -> str:
    """The benchmark script of a result name: itself, or the longest script name it starts with."""
    stems = sorted((s.stem for s in (ROOT / "benchmarks").glob("[!_]*.py")), key=len, reverse=True)
    return next((stem for stem in stems if name == stem or name.startswith(stem + "_")), name)


def short_machine(record: Record) -> str:
    """The machine and date in a few words, for a plot's subtitle."""
    m = record["measured"]
    load = (m.get("load_average_at_end") or ["?"])[0]
    return (f"{m['cpu']} ({', '.join(m.get('cpu_flags') or [])}), {m['cores']} shared cores (load {load}), "
            f"{m['date'][:10]}")


def number(value: Any) -> str:
    """A figure as a table shows it: thousands separated, at most three decimals."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"
    return str(value)


def flat(figures: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested figures as ``a.b`` keys (lists shown whole)."""
    out: dict[str, Any] = {}
    for key, value in figures.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def figures_table(record: Record, skip: tuple[str, ...] = ()) -> str:
    """Every figure of a run's last line, one row each; the figures the run left out (None: a workload
    not asked for) are named after the table, not shown as numbers."""
    figures = {key: value for key, value in flat(record["figures"]).items() if not key.startswith(skip)}
    rows = [f"| `{key}` | {number(value)} |" for key, value in figures.items() if value is not None]
    table = "| figure | value |\n|---|---:|\n" + "\n".join(rows)
    left_out = [f"`{key}`" for key, value in figures.items() if value is None]
    return table + (f"\n\nNot measured in this run: {', '.join(left_out)}." if left_out else "")


class Plots:
    """Where a run's plots go, relative to the pages that show them, and which plots this run wrote."""

    def __init__(self, directory: Path, pages: Path) -> None:
        self.directory = directory
        self.link_base = Path(os.path.relpath(directory, pages)).as_posix()
        self.written: list[Path] = []

    def save(self, figure: Any, record: Record, stem: str) -> str:
        """Save a matplotlib figure as ``<stem>.png`` and return the page's image line:
        ``plots.save(figure, record, "multiturn-ttft")``."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{stem}.png"
        figure.text(0.01, 0.01, f"measured on {short_machine(record)}; shared CPU: noisy", fontsize=7,
                    color="0.35")
        figure.savefig(path, dpi=110, metadata={"Software": None})
        plt.close(figure)
        self.written.append(path)
        return f"![{stem.replace('-', ' ')}]({self.link_base}/{path.name})"


def multiturn(record: Record, plots: Plots) -> str:
    """TTFT per turn against the history's length, every path of the run, as a plot and a table."""
    rows = record["series"].get("rows") or []
    paths = {"agentkv_ttft": "agentkv, stateful engine", "paged_ttft": "agentkv, paged engine (default)",
             "stateless_ttft": "stateless re-prefill", "genai_chat_ttft": "LLMPipeline SDPA + ChatHistory",
             "genai_default_ttft": "LLMPipeline default + ChatHistory"}
    parts = [figures_table(record)]
    if rows:
        figure, axes = plt.subplots(figsize=(7.5, 4.2))
        history = [r["history_tokens"] for r in rows]
        for key, label in paths.items():
            axes.plot(history, [r[key] * 1000 for r in rows], marker="o", markersize=3, label=label)
        axes.set(xlabel="tokens of history", ylabel="time to first token (ms)", yscale="log",
                 title="Multi-turn chat: time to first token per turn")
        axes.legend(fontsize=8)
        axes.grid(alpha=0.3)
        figure.tight_layout(rect=(0, 0.04, 1, 1))
        parts.insert(0, plots.save(figure, record, "multiturn-ttft"))
        head = "| turn | history tokens | prefilled (stateful) | " + " | ".join(paths.values()) + " |"
        lines = [head, "|" + "---:|" * (3 + len(paths))]
        lines += [f"| {r['turn']} | {r['history_tokens']:,} | {r['agentkv_prefilled']:,} | "
                  + " | ".join(f"{r[k] * 1000:,.0f}" for k in paths) + " |" for r in rows]
        parts.append("Time to first token per turn, in ms:\n\n" + "\n".join(lines))
    return "\n\n".join(parts)


def concurrency(record: Record, plots: Plots) -> str:
    """Aggregate decode tokens/s against the number of conversations answering together."""
    rates = record["figures"].get("tokens_per_s") or {}
    parts = [figures_table(record, skip=("tokens_per_s",))]
    if rates:
        counts = sorted(rates, key=int)
        figure, axes = plt.subplots(figsize=(7, 4))
        axes.plot([int(c) for c in counts], [rates[c] for c in counts], marker="o")
        axes.set(xlabel="conversations answering together", ylabel="decode tokens/s (all together)",
                 xscale="log", title="Paged engine: conversations batched in shared steps")
        axes.set_xticks([int(c) for c in counts], counts)
        axes.minorticks_off()
        axes.set_ylim(bottom=0)
        axes.grid(alpha=0.3)
        figure.tight_layout(rect=(0, 0.04, 1, 1))
        parts.insert(0, plots.save(figure, record, "concurrency-tokens-per-s"))
        parts.append("| conversations | tokens/s |\n|---:|---:|\n"
                     + "\n".join(f"| {c} | {number(rates[c])} |" for c in counts))
    return "\n\n".join(parts)


def window(record: Record, plots: Plots) -> str:
    """Per policy: the latency of the turn that compacts and of the others, and the total."""
    policies = record["figures"].get("policies") or {}
    parts = [figures_table(record, skip=("policies",))]
    if policies:
        names = list(policies)
        lines = ["| policy | total (s) | turn that compacts: mean / worst (ms) | other turns: mean / worst (ms) "
                 "| compactions | compaction cost: mean / worst (ms) | largest prompt (tokens) |",
                 "|---|---:|---:|---:|---:|---:|---:|"]
        for name in names:
            p = policies[name]
            pair = lambda d: f"{number(d['mean'])} / {number(d['max'])}"  # noqa: E731
            lines.append(f"| {name} | {number(p['total_s'])} | {pair(p['compacting_turn_ms'])} | "
                         f"{pair(p['other_turn_ms'])} | {p['compactions']} | {pair(p['compaction_cost_ms'])} | "
                         f"{number(p['max_prompt_tokens'])} |")
        parts.append("\n".join(lines))
        figure = paired_bars(names, ([policies[n]["compacting_turn_ms"]["mean"] or 0 for n in names],
                                     [policies[n]["other_turn_ms"]["mean"] or 0 for n in names]),
                             ("turn that compacts (mean)", "other turns (mean)"),
                             ylabel="ms to the first token, as a user waits", title="Context-window policies",
                             size=(7, 4), bottom=0.04)
        parts.insert(0, plots.save(figure, record, "window-turn-latency"))
    return "\n\n".join(parts)


def token_overhead(record: Record, plots: Plots) -> str:
    """Per-token overhead of each decode loop, as bars beside the table."""
    figures = record["figures"]
    loops = {k.removeprefix("overhead_ms_"): v for k, v in figures.items() if k.startswith("overhead_ms_")}
    parts = [figures_table(record)]
    if loops:
        figure, axes = plt.subplots(figsize=(7, 3.6))
        axes.bar(list(loops), list(loops.values()))
        axes.set(ylabel="ms per token outside the model", title="Per-token overhead of plain decoding")
        figure.tight_layout(rect=(0, 0.05, 1, 1))
        parts.insert(0, plots.save(figure, record, "token-overhead"))
    return "\n\n".join(parts)


def decode(record: Record, plots: Plots) -> str:
    """Decode tokens/s per workload, plain against agentkv's defaults (fast-forward and drafts), as bars."""
    f = record["figures"]
    pairs = {}
    if f.get("plain_decode_tps_toolcalls") and f.get("spec_over_plain_toolcalls"):
        pairs["tool calls"] = (f["plain_decode_tps_toolcalls"],
                               f["plain_decode_tps_toolcalls"] * f["spec_over_plain_toolcalls"])
    for key, label in (("quote", "quoting"), ("freetext", "free text")):
        if f.get(f"plain_decode_tps_{key}") and f.get(f"spec_decode_tps_{key}"):
            pairs[label] = (f[f"plain_decode_tps_{key}"], f[f"spec_decode_tps_{key}"])
    parts = [figures_table(record)]
    if pairs:
        heights = ([plain for plain, _ in pairs.values()], [fast for _, fast in pairs.values()])
        figure = paired_bars(list(pairs), heights,
                             ("plain decoding", "agentkv's defaults (fast-forward, drafts)"),
                             ylabel="decode tokens/s", title="Decoding: same answers, fewer model steps",
                             size=(7, 3.8), bottom=0.05)
        parts.insert(0, plots.save(figure, record, "decode-tokens-per-s"))
    return "\n\n".join(parts)


def paired_bars(groups: list[str], values: tuple[list[float], list[float]], labels: tuple[str, str], *, ylabel: str,
                title: str, size: tuple[float, float], bottom: float) -> Any:
    """Two bars per group, side by side, with a legend (the window and decode plots)::

        paired_bars(["tool calls"], ([40.1], [126.0]), ("plain", "fast"), ylabel="tokens/s", title="Decoding",
                    size=(7, 4), bottom=0.05)
    """
    figure, axes = plt.subplots(figsize=size)
    xs = range(len(groups))
    for offset, heights, label in zip((-0.2, 0.2), values, labels):
        axes.bar([x + offset for x in xs], heights, 0.4, label=label)
    axes.set_xticks(list(xs), groups)
    axes.set(ylabel=ylabel, title=title)
    axes.legend(fontsize=8)
    figure.tight_layout(rect=(0, bottom, 1, 1))
    return figure


def generic(record: Record, plots: Plots) -> str:
    """A run's figures as a table (benchmarks without a plot of their own)."""
    return figures_table(record)


RENDERERS: dict[str, Callable[[Record, Plots], str]] = {
    "multiturn": multiturn, "concurrency": concurrency, "window": window, "token_overhead": token_overhead,
    "decode": decode}

HEADLINES: dict[str, tuple[str, str]] = {
    "multiturn": ("paged_over_genai_default_ttft", "TTFT against openvino-genai's default pipeline (median, turns 2+)"),
    "concurrency": ("batched_over_sequential_8", "8 conversations batched against one after another"),
    "prefix": ("cold_over_cached_ttft_paged", "a shared system prompt: cold TTFT over from the prefix cache (paged)"),
    "window": ("truncation_over_sliding_compacting_turn", "the turn that compacts: Truncation over SlidingWindow"),
    "snapshot": ("reprefill_over_restore", "a new process: re-prefill over restore from a snapshot"),
    "server": ("server_over_direct_ttft", "TTFT through `agentkv serve` over the Python API"),
    "token_overhead": ("overhead_ms_thread", "ms per token outside the model (default decode loop)"),
    "function_calling": ("valid_ratio", "function-calling cases whose calls validate"),
    "decode": ("spec_over_plain_toolcalls", "tool-call decode speed: fast-forward + drafts over plain"),
    "kv_store": ("turn_bytes_over_new_kv", "bytes a conversation's saves wrote over its KV"),
    "scaleout": ("moved_reprefill_over_moved_restore", "a moved conversation: re-prefill over restore"),
}


SHOWN_AS: dict[str, Callable[[dict[str, Any]], str]] = {
    "function_calling": lambda figures: f"{figures['valid_cases']}/{figures['cases']}"}
"""Headline figures read better another way than their key's number (valid cases of all cases)."""
PAGE_OF = {"token_overhead": "decode.md#per-token-overhead"}
"""Results shown on another benchmark's page (the rest have a page of their own name)."""


def not_measured(name: str) -> str:
    """What a page says where no saved run exists: how to measure it, no number."""
    script = script_named(name)
    return (f"!!! note \"Not measured for these pages\"\n    No saved run of `benchmarks/{script}.py` is in "
            f"`benchmarks/results/{name}.json`, so this page shows no figures rather than old ones. Run "
            f"`python benchmarks/{script}.py` (it saves its run), then `make docs-figures`.")


def headline(records: dict[str, Record]) -> str:
    """The index page's table: one figure per measured benchmark, each with its machine and date."""
    lines = ["| benchmark | figure | value | measured on |", "|---|---|---:|---|"]
    for name, (key, label) in HEADLINES.items():
        record = records.get(name)
        value = flat(record["figures"]).get(key) if record else None
        shown = "not measured" if value is None or record is None else (
            SHOWN_AS[name](record["figures"]) if name in SHOWN_AS else number(value))
        where = short_machine(record) if record and value is not None else "—"
        lines.append(f"| [{name}]({PAGE_OF.get(name, name + '.md')}) | {label} (`{key}`) | {shown} | {where} |")
    return "\n".join(lines)


def block_text(name: str, records: dict[str, Record], plots: Plots) -> str:
    """What a page's generated block for ``name`` holds now."""
    if name == "headline":
        return headline(records)
    record = records.get(name)
    if record is None:
        return not_measured(name)
    body = RENDERERS.get(name, generic)(record, plots)
    return f"{body}\n\n*{measured_on(record)}*"


def load_records(results: Path) -> dict[str, Record]:
    """Every saved run, by its result name."""
    return {path.stem: json.loads(path.read_text(encoding="utf-8")) for path in sorted(results.glob("*.json"))}


def write_figures(results: Path = RESULTS, pages: Path = PAGES, figures: Path = FIGURES) -> str:
    """Fill every page's generated blocks from the saved runs and delete the plots no block uses;
    returns what it did in one line: ``write_figures()`` (the defaults are the repository's)."""
    records = load_records(results)
    plots = Plots(figures, pages)
    changed = 0
    for page in sorted(pages.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        new = BLOCK.sub(lambda m: f"{m.group(1)}{block_text(m.group('name'), records, plots)}\n{m.group(3)}", text)
        if new != text:
            page.write_text(new, encoding="utf-8")
            changed += 1
    stale = [p for p in figures.glob("*.png") if p not in plots.written] if figures.is_dir() else []
    for path in stale:
        path.unlink()
    return (f"docs_figures: {len(records)} saved runs, {len(plots.written)} plots, {changed} pages changed, "
            f"{len(stale)} superseded plots removed")


if __name__ == "__main__":
    print(write_figures())
