"""Benchmarks' ``--model``: a realistic-size model's name resolves to its built directory, built on demand.

The names are those of scripts/build_sized_model.py (``qwen2.5-1.5b-shape``: a Qwen2.5-1.5B-shaped,
random-weight int4 IR in the user cache, ~1 GB); anything else passes through to ``open_engine``
unchanged (a path, or None for the default model)::

    engine = open_engine(model_arg(args.model)) if args.model else open_engine()
    path = sized_model_dir("qwen2.5-1.5b-shape")      # builds it first when missing (`make sized-model`)

A missing model is built with ``make sized-model SIZED_MODEL=<name>`` (which sets up ``.zoo-venv``
from the ``zoo`` extra when missing: torch, transformers, optimum-intel; ~10 min on 2 cores);
a build that cannot run is ``ModelNotFound`` naming that command.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from agentkv.errors import ModelNotFound

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "scripts" / "build_sized_model.py"


def _builder() -> ModuleType:
    """scripts/build_sized_model.py as a module (its torch imports are inside its build functions):
    the one list of names, the cache layout and the manifest check."""
    spec = importlib.util.spec_from_file_location("build_sized_model", BUILD_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def sized_model_names() -> list[str]:
    """The names ``--model`` resolves here: ``sized_model_names() == ["qwen2.5-1.5b-shape"]``."""
    return sorted(_builder().SHAPES)


def build_command(name: str) -> list[str]:
    """The command that builds ``name`` (from the repository's root): ``make sized-model SIZED_MODEL=…``."""
    return ["make", "-C", str(ROOT), "sized-model", f"SIZED_MODEL={name}"]


def sized_model_dir(name: str, *, build: bool = True) -> Path:
    """The directory of the built model ``name``; when it is not built, build it first (``build``
    True) or raise ``ModelNotFound`` naming the command: ``sized_model_dir("qwen2.5-1.5b-shape")``."""
    builder = _builder()
    if name not in builder.SHAPES:
        raise ModelNotFound(f"no realistic-size model named {name!r}; known: {', '.join(sorted(builder.SHAPES))}")
    target = builder.cache_models_dir() / name
    if builder.built_manifest(target, name) is not None:
        return Path(target)
    command = build_command(name)
    shown = f"make sized-model SIZED_MODEL={name}"
    if not build:
        raise ModelNotFound(f"{name} is not built in {target}; build it with `{shown}` (from {ROOT})")
    if shutil.which(command[0]) is None:
        raise ModelNotFound(f"{name} is not built in {target} and `make` is not installed; install make, "
                            f"then run `{shown}` (from {ROOT})")
    print(f"building {name} into {target} ({shown}; ~10 min on 2 cores, once)", file=sys.stderr, flush=True)
    finished = subprocess.run(command, check=False)
    if finished.returncode != 0 or builder.built_manifest(target, name) is None:
        raise ModelNotFound(f"building {name} failed (`{' '.join(command)}` exited {finished.returncode}); "
                            f"see its output above, fix it, then run `{shown}` (from {ROOT})")
    return Path(target)


def model_arg(value: str | None) -> str | None:
    """A benchmark's ``--model`` value as ``open_engine`` takes it: a realistic-size model's name becomes
    its directory (built on demand); a path or None passes through: ``model_arg("qwen2.5-1.5b-shape")``."""
    if value is not None and value in sized_model_names():
        return str(sized_model_dir(value))
    return value
