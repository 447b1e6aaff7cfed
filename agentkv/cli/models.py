"""``agentkv models``: the cached models, what a model directory holds, and GGUF → IR conversion.

::

    agentkv models list                       # cached models, their size, what uses them, the stale ones
    agentkv models prune                      # remove the stale conversions (--dry-run, --yes)
    agentkv models info path/to/qwen2.5-ov    # family, template, tool format, RoPE, context, KV bytes/token
    agentkv models info path/to/ir --open     # also compile it: which engine open_engine picks, and why
    agentkv models convert model.gguf         # GGUF → OpenVINO IR in the model cache

``info`` reads ``config.json``, ``tokenizer_config.json`` and ``generation_config.json`` (or a
GGUF's metadata), and the chat template as the runtime does (``read_chat_template``: the tokenizer
IR's rt_info, ``chat_template.jinja``, ``tokenizer_config.json``); it compiles the tokenizer IRs
only (~0.3 s), never the model. Bad input exits 2 with one line saying what to do.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import anyio
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentkv.chat.messages import ToolCall
from agentkv.cli.model_cache import list_models, prune
from agentkv.engine.openvino.models import (
    IR_FILES,
    ModelFiles,
    resolve_model,
)
from agentkv.errors import AgentKVError, ModelNotFound

models_app = typer.Typer(help="Models: what a model directory holds, the models converted into the cache, "
                         "and converting a GGUF or Hugging Face model to OpenVINO IR.",
                         no_args_is_help=True, rich_markup_mode=None)
out = Console()
err = Console(stderr=True)
EXIT_BAD_INPUT = 2
OPTIMUM_INSTALL = "pip install 'optimum[openvino]'"


class OptimumIntelMissing(AgentKVError):
    """Converting a Hugging Face directory needs optimum-intel, which agentkv does not install:
    ``raise OptimumIntelMissing(Path("Qwen2.5-0.5B-Instruct"))``."""

    def __init__(self, path: Path) -> None:
        super().__init__(
            f"{path} is a Hugging Face model; converting it needs optimum-intel, which agentkv does "
            f"not install: {OPTIMUM_INSTALL}, then run this command again (or `optimum-cli export "
            f"openvino --model {path} {path}-ov`)")


@dataclass(frozen=True)
class ModelInfo:
    """What ``agentkv models info`` shows: ``describe(Path("qwen-ov")).rows()``."""

    path: Path
    config: dict[str, Any]
    """``config.json`` (or the GGUF metadata mapped onto its names)."""
    template: str
    """The chat template's source ('' when there is none)."""
    tokenizer_config: dict[str, Any]
    eos_ids: list[int]
    files: list[str]
    """The files that matter to agentkv, present in the directory."""

    def rows(self) -> list[tuple[str, str]]:
        """(label, value) pairs, in display order: ``describe(path).rows()[0]`` → ``("family", "qwen2 …")``."""
        c = self.config
        layers, heads = c.get("num_hidden_layers"), c.get("num_attention_heads")
        kv_heads = c.get("num_key_value_heads") or heads
        head_dim = c.get("head_dim") or (c["hidden_size"] // heads if c.get("hidden_size") and heads else None)
        return [
            ("family", f"{c.get('model_type', '?')} ({', '.join(c.get('architectures') or ['?'])})"),
            ("template", self._template_features()),
            ("special tokens", self._special_tokens()),
            ("eos ids", ", ".join(map(str, self.eos_ids)) or "none found"),
            ("tool format", _tool_format(self.template, self.tokenizer_config)),
            ("rope", _rope(c)),
            ("attention", f"{layers} layers, {heads} heads, {kv_heads} KV heads, head_dim {head_dim}"
             + (f", sliding window {c['sliding_window']}" if c.get("sliding_window") else "")
             + (f", logit softcap {c['final_logit_softcapping']}" if c.get("final_logit_softcapping") else "")),
            ("context length", str(c.get("max_position_embeddings", "unknown"))),
            ("KV bytes/token", _kv_bytes(layers, kv_heads, head_dim)),
            ("files", ", ".join(self.files)),
        ]

    def _template_features(self) -> str:
        if not self.template:
            return "none (agentkv renders ChatML)"
        features = ["takes tools=" if "tools" in self.template else "no tools="]
        if "<think>" in self.template:
            features.append("thinking (<think>)")
        if "raise_exception" in self.template:
            features.append("raises on some role orders")
        return ", ".join(features)

    def _special_tokens(self) -> str:
        names = ("bos_token", "eos_token", "pad_token")
        found = [f"{name.removesuffix('_token')} {_token_text(self.tokenizer_config.get(name))}"
                 for name in names if self.tokenizer_config.get(name)]
        return ", ".join(found) or "none listed"


def _token_text(value: Any) -> str:
    return str(value.get("content") if isinstance(value, dict) else value)


def _tool_format(template: str, tokenizer_config: dict[str, Any]) -> str:
    """The tool-call format agentkv gives the model (``chat.tool_formats.detect_tool_format``, the
    table the runner uses), from its template and its added tokens."""
    from agentkv.chat.tool_formats import detect_tool_format

    added = {_token_text(t) for t in (tokenizer_config.get("added_tokens_decoder") or {}).values()}
    found = detect_tool_format(template, added)
    example = found.format_calls([ToolCall(id="a1b2c3d4e", name="name", arguments={})]).replace("\n", " ")
    fallback = "" if found.name != "hermes" or "<tool_call>" in template else " (the fallback: the template names none)"
    return f"{found.name}: {example}{fallback}"


def _rope(c: dict[str, Any]) -> str:
    parts = [f"θ {c.get('rope_theta', 'unknown')}"]
    if c.get("rope_local_base_freq"):
        parts.append(f"local θ {c['rope_local_base_freq']}")
    scaling = c.get("rope_scaling")
    if isinstance(scaling, dict):
        parts.append(f"scaling {scaling.get('rope_type') or scaling.get('type')}")
    if c.get("partial_rotary_factor"):
        parts.append(f"partial rotary {c['partial_rotary_factor']}")
    return ", ".join(parts)


def _kv_bytes(layers: Any, kv_heads: Any, head_dim: Any) -> str:
    """Bytes of KV per token at the precision the paged engine will use here (``PagedModel``'s
    own choice: ``default_block_precision``)."""
    from agentkv.engine.openvino.engine import KV_BYTES
    from agentkv.engine.paged.block_precision import default_block_precision

    if not (layers and kv_heads and head_dim):
        return "unknown (config lacks layers, heads or head_dim)"
    precision = default_block_precision("CPU")
    per_token = 2 * layers * kv_heads * head_dim * KV_BYTES[precision]
    return f"{per_token:,} ({precision}: the paged engine's KV precision on this CPU)"


_GGUF_KEYS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
              "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
              "embedding_length": "hidden_size", "rope.freq_base": "rope_theta",
              "attention.sliding_window": "sliding_window"}


def _config_from_gguf(meta: dict[str, Any]) -> dict[str, Any]:
    arch = str(meta.get("general.architecture", "?"))
    config: dict[str, Any] = {"model_type": arch, "architectures": [f"GGUF {arch}"]}
    for key, name in _GGUF_KEYS.items():
        if f"{arch}.{key}" in meta:
            config[name] = meta[f"{arch}.{key}"]
    return config


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelNotFound(f"cannot read {path}: {error}; re-export the model or fix the file") from None
    if not isinstance(value, dict):
        raise ModelNotFound(f"{path} is not a JSON object; re-export the model or fix the file")
    return value


def describe(path: Path) -> ModelInfo:
    """Read what ``agentkv models info`` shows from ``path`` (a model directory or a ``.gguf``),
    compiling nothing but the tokenizer IRs (for the template):
    ``describe(Path("tests/data/zoo/gemma2")).config["sliding_window"]`` → 32."""
    if path.is_file() and path.suffix == ".gguf":
        import gguf

        reader = gguf.GGUFReader(str(path))
        meta = {name: field.contents() for name, field in reader.fields.items()
                if not name.startswith("tokenizer.ggml.") or name.endswith("_id")}
        return _from_gguf(path, meta, [path.name])
    if not path.exists():
        raise ModelNotFound(f"no model at {path}: pass an OpenVINO IR directory, a Hugging Face "
                            "directory or a .gguf file")
    if not path.is_dir():
        raise ModelNotFound(f"{path} is neither a directory nor a .gguf file: pass a model directory or a .gguf")
    wanted = (*IR_FILES, "config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json")
    files = [name for name in wanted if (path / name).is_file()] + sorted(p.name for p in path.glob("*.gguf"))
    if "config.json" not in files:
        gguf_path = next(iter(sorted(path.glob("*.gguf"))), None)
        if gguf_path is None:
            raise ModelNotFound(f"{path} is not a model directory (no config.json, no .gguf); pass the "
                                "directory optimum-cli exported, or a .gguf file")
        return _from_gguf(path, ModelFiles(ir_dir=path, gguf_path=gguf_path).gguf_metadata(), files)
    tokenizer_config = _read_json(path / "tokenizer_config.json")
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(i) for i in eos]
    template = _runtime_template(path) if "openvino_tokenizer.xml" in files else _hf_template(path, tokenizer_config)
    return ModelInfo(path, _read_json(path / "config.json"), template, tokenizer_config, eos_ids, files)


def _runtime_template(ir_dir: Path) -> str:
    """The template the runtime renders with, read the runtime's way (``read_chat_template``: the
    tokenizer IR's rt_info, then chat_template.jinja, then tokenizer_config.json)."""
    from agentkv.engine.openvino.tokenizer import read_chat_template

    try:
        return read_chat_template(ir_dir)
    except RuntimeError as error:
        first = (str(error).strip().splitlines() or ["no message"])[0]
        raise ModelNotFound(f"cannot read the tokenizer IR in {ir_dir}: {first}; re-export the model") from None


def _hf_template(path: Path, tokenizer_config: dict[str, Any]) -> str:
    """A Hugging Face directory's template, where transformers reads it (chat_template.jinja, then
    tokenizer_config.json's chat_template), which is what an export carries into the tokenizer IR."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template") or ""
    if isinstance(template, list):  # named templates: [{"name": "default", "template": "…"}, …]
        template = " ".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return str(template)


def _from_gguf(path: Path, meta: dict[str, Any], files: list[str]) -> ModelInfo:
    eos = meta.get("tokenizer.ggml.eos_token_id")
    template = (_runtime_template(path) if "openvino_tokenizer.xml" in files
                else str(meta.get("tokenizer.chat_template") or ""))
    return ModelInfo(path, _config_from_gguf(meta), template, {}, [] if eos is None else [int(eos)], files)


def _engine_choice(path: Path) -> str:
    """Compile the model with ``open_engine`` and say which engine it picked and why."""
    from agentkv.engine.factory import open_engine

    reasons: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            reasons.append(record.getMessage())

    handler = Keep(logging.WARNING)
    logger = logging.getLogger("agentkv.engine.factory")
    logger.addHandler(handler)
    try:
        with err.status(f"Compiling {path.name} to see which engine runs it…"):
            engine = open_engine(path, chunk_graph=False)  # only which engine: no second graph
        anyio.run(engine.aclose)
    finally:
        logger.removeHandler(handler)
    name = type(engine).__name__
    return f"{name}: {reasons[0]}" if reasons else f"{name} (the default on CPU)"


def _bad_input(error: AgentKVError) -> typer.Exit:
    err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)
    return typer.Exit(EXIT_BAD_INPUT)


@models_app.command("info")
def info(
    path: Path = typer.Argument(..., metavar="PATH",
                                help="OpenVINO IR directory, Hugging Face directory or .gguf file."),
    open_: bool = typer.Option(False, "--open", help="Also compile the model, to say which engine (paged or "
                               "stateful) will run it, and why (slow: seconds to minutes)."),
) -> None:
    """What a model is and how agentkv will run it: family, chat template, tool-call format, RoPE,
    context length, KV bytes per token. Read from its files; only the tokenizer is compiled."""
    try:
        described = describe(path.expanduser())
        rows = described.rows()
        rows.append(("engine", _engine_choice(path.expanduser()) if open_ else
                     "paged on CPU/GPU, stateful on NPU or when the paged form fails (--open checks)"))
    except AgentKVError as error:
        raise _bad_input(error) from None
    table = Table(show_header=False, box=None, title=str(path), title_justify="left")
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, value in rows:
        table.add_row(label, escape(value))
    out.print(table)


models_app.command("list")(list_models)
models_app.command("prune")(prune)


@models_app.command("convert")
def convert(
    source: Optional[Path] = typer.Argument(
        None, metavar="SOURCE", help="A .gguf file or a Hugging Face directory (default: the default model)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", metavar="DIR",
                                          help="Also copy the converted model here (a directory not there yet)."),
) -> None:
    """Convert a GGUF (into the model cache) or a Hugging Face directory (beside it, with optimum-intel)
    to OpenVINO IR, showing each step."""
    try:
        target = _convert(source.expanduser() if source else None, output)
    except AgentKVError as error:
        raise _bad_input(error) from None
    out.print(f"OpenVINO IR: {target}", soft_wrap=True)


def _convert(source: Path | None, output: Path | None) -> Path:
    if output is not None and output.exists():
        raise ModelNotFound(f"{output} already exists: pass a new directory to --output")
    if source is not None and source.is_dir():
        if all((source / name).is_file() for name in IR_FILES):
            raise ModelNotFound(f"{source} is already an OpenVINO IR: use it as it is (`agentkv models info {source}`)")
        if not (source / "config.json").is_file():
            raise ModelNotFound(f"{source} is not a model directory (no config.json): pass a .gguf file "
                                "or a Hugging Face model directory")
        return _convert_hf(source, output or source.with_name(source.name + "-ov"))
    if source is not None and not (source.is_file() and source.suffix == ".gguf"):
        raise ModelNotFound(f"no .gguf file or model directory at {source}")
    files = resolve_model(source)  # converts once (with a spinner), then reads the cache
    if output is None:
        return files.ir_dir
    shutil.copytree(files.ir_dir, output)
    return output


def _convert_hf(source: Path, output: Path) -> Path:
    if importlib.util.find_spec("optimum") is None or importlib.util.find_spec("optimum.intel") is None:
        raise OptimumIntelMissing(source)
    command = [shutil.which("optimum-cli") or "optimum-cli", "export", "openvino", "--model", str(source), str(output)]
    said = _run_with_progress(command, f"Converting {source.name} with optimum-intel")
    if said is not None:
        raise ModelNotFound(f"optimum-cli could not convert {source}: {said}")
    return output


def _run_with_progress(command: list[str], title: str) -> str | None:
    """Print ``title``, then run ``command`` under a progress bar whose text is the last line it
    printed (optimum-cli names its steps: loading, exporting, converting the tokenizer…); None when
    it succeeded, else its last line."""
    from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from agentkv.engine.openvino import models as model_files

    last = "no output"
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn())
    console = model_files.progress_console()
    console.print(title)
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task("starting optimum-cli", total=None)
        with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as process:
            for line in process.stdout or ():
                if line.strip():
                    last = line.strip()
                    progress.update(task, description=last[:60])
                    progress.refresh()
    return None if process.returncode == 0 else last
