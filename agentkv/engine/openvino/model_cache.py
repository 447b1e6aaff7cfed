"""The model cache's conversions: which ones a setting uses, which are stale, and removing the stale.

Each GGUF is converted once into ``<cache>/models/<stem>-<key>``, the key hashing the GGUF's path,
size and modification time: a reinstalled or upgraded default model gets a new directory and the
old one (~99 MB for the default model) would stay forever. ``conversions`` sorts them out::

    found = conversions({gguf_ir_dir(default_gguf_path()): "default"})
    freed = remove([c for c in found if c.stale])      # bytes freed
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from agentkv.engine.openvino.models import SOURCE_FILE, cache_root, gguf_key

WORK_PREFIX = ".convert-"
"""The private work directories conversions rename into place (``models._ensure_ir_for_gguf``)."""
WORK_AGE_S = 3600.0
"""A work directory older than this is left over from an interrupted conversion, not one running."""


@dataclass(frozen=True)
class Conversion:
    """One directory of the model cache: ``conversions({})[0].stale``."""

    path: Path
    size: int
    """Bytes, the GGUF inside excluded (a hard link to the original, most often)."""
    use: str
    """The setting that uses it ("default", "$AGENTKV_MODEL"…), '' when none does."""
    stale: str
    """Why no current setting can use it again ('' when it is current or unknown)."""


def conversions(in_use: Mapping[Path, str], root: Path | None = None) -> list[Conversion]:
    """Every directory of ``root`` (default: ``<cache>/models``) with its use and staleness.
    ``in_use`` maps the directories current settings resolve to, to the setting's name. A
    conversion not in use is stale when its GGUF is gone or changed since (its recorded source
    no longer hashes to its directory), when it is an older conversion of a model in use (same
    GGUF name, other key: directories from before sources were recorded), or when it is a work
    directory an interrupted conversion left:
    ``conversions({Path("~/.cache/agentkv/models/SmolLM2-…-4f69a45be7"): "default"})``."""
    root = root or cache_root() / "models"
    if not root.is_dir():
        return []
    used_stems = {_stem(path.name) for path in in_use}
    found = []
    for path in sorted(p for p in root.iterdir() if p.is_dir()):
        use = in_use.get(path, "")
        stale = "" if use else _why_stale(path, used_stems)
        if path.name.startswith(".") and not stale:
            continue  # a conversion running now, or not ours
        found.append(Conversion(path, _size(path), use, stale))
    return found


def remove(stale: Iterable[Conversion]) -> int:
    """Delete ``stale``'s directories; the bytes freed (GGUF links excluded): a directory that
    could not be removed (in use, no permission) frees nothing and stays listed as stale."""
    freed = 0
    for conversion in stale:
        shutil.rmtree(conversion.path, ignore_errors=True)
        if not conversion.path.exists():
            freed += conversion.size
    return freed


def _why_stale(path: Path, used_stems: set[str]) -> str:
    if path.name.startswith(WORK_PREFIX):
        old = time.time() - path.stat().st_mtime > WORK_AGE_S
        return "left by an interrupted conversion" if old else ""
    source = _recorded_source(path)
    if source is not None:
        if not source.is_file():
            return f"its GGUF is gone ({source})"
        if gguf_key(source) != path.name:
            return "its GGUF changed since (reinstalled or upgraded)"
        return ""
    if _stem(path.name) in used_stems:
        return "an older conversion of a model in use"
    return ""


def _recorded_source(path: Path) -> Path | None:
    record = path / SOURCE_FILE
    try:
        return Path(json.loads(record.read_text(encoding="utf-8"))["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _stem(name: str) -> str:
    """A conversion's GGUF stem: its directory name without the ``-<key>`` suffix."""
    return name.rpartition("-")[0] or name


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and p.suffix != ".gguf")
