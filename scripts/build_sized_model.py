"""Build a realistic-size model (random weights, the shape of a published one) into the user cache.

Issue 47: benchmarks must run at the sizes users run, and the real weights are not reachable here
(no model hub). This builds a model of the real architecture and size, exported as OpenVINO's
published int4 models are, so that timings and memory are real (answers are meaningless)::

    make sized-model                                        # qwen2.5-1.5b-shape, .zoo-venv made if missing
    .zoo-venv/bin/python scripts/build_sized_model.py qwen2.5-1.5b-shape [--out DIR]
    python3 scripts/build_sized_model.py --check qwen2.5-1.5b-shape   # exit 0 when built (no torch needed)

Output: ``$AGENTKV_CACHE_DIR/models/<name>/`` (default ``~/.cache/agentkv/models/<name>/``, as the
runtime's cache on Linux), never in the repository. Idempotent: the directory's manifest
(``agentkv_sized_model.json``, written last, with the recipe's hash) makes a second call return at
once; a changed recipe builds again. Atomic: built in a temp dir beside the target, renamed at the
end; a lock file serialises two concurrent builds.

**qwen2.5-1.5b-shape** is Qwen2.5-1.5B-Instruct's ``config.json``: Qwen2ForCausalLM, 28 layers,
hidden 1536, intermediate 8960, 12 heads / 2 KV heads (head_dim 128), vocab 151,936 rows, tied
embeddings, rope_theta 1e6, max_position_embeddings 32,768, RMSNorm eps 1e-6, q/k/v biases;
random init (seed 1234, std 0.02, bf16) exported by optimum-intel with ``--weight-format int4 --sym
--group-size 128 --ratio 1.0`` (the embedding / LM head stay int8 as nncf's backup precision, as in
the published int4 IRs). What differs from the real model:

- the weights are random: the logits are noise, greedy answers are arbitrary tokens;
- the tokenizer: byte-level BPE trained on tests/data/zoo/corpus.txt (~2.4K merged tokens, GPT-2's
  pre-tokenizer regex, not Qwen's), padded with unreachable filler word pieces to Qwen's layout:
  151,643 ordinary ids, then the 22 real special / added tokens at their real ids
  (``<|endoftext|>`` 151643, ``<|im_start|>`` 151644, ``<|im_end|>`` 151645, ``<tool_call>``
  151657…), 151,665 in all; the embedding has 151,936 rows as the real one. English text takes
  more tokens than with Qwen's 151K merges; fillers are never produced by encoding but decode to
  lowercase word pieces when the random model emits them;
- the template is the real Qwen2.5 one (tests/data/templates/qwen2_5.jinja); generation_config
  holds the real EOS list (151645, 151643) and no sampling defaults.

Measured (2026-11-28, 2 shared avx2 cores, ``make sized-model`` with .zoo-venv installed): 4 min
36 s (random init and save 62 s, optimum-intel export with nncf's int4 compression 197 s), 1.54 B
parameters (1,543,714,304: the real count), 920 MB of IR; peak RSS 3.8 GiB while the bf16 torch
model is made and saved, 4.3 GiB in the export (1.5x the bf16 weights' 3.1 GB).

**What fits: the 1.5B class, not the 8B class.** The export's peak scales with the bf16 weights (the
torch model is loaded whole, then converted and compressed): from the 1.5B's 4.3 GiB, a Qwen2.5-7B
shape (7.62 B parameters) would peak at ~21 GiB and a Llama-3.1-8B shape (8.03 B) at ~22.5 GiB, on a
machine of 23 GiB with no swap whose other users held 5-10 GiB during the build: no margin, so no
8B shape is defined here and none was tried. Its int4 IR (~4.5-5 GB) would run on this machine;
making it needs either ~32 GiB free for this export path or a builder that writes the IR layer by
layer without a whole torch model (not done).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import gc
import hashlib
import json
import os
import random
import resource
import shutil
import string
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

MANIFEST = "agentkv_sized_model.json"
"""Written last into a built model's directory: its recipe hash, config, sizes and build costs."""
SEED = 1234
EXPORT_ARGS = ["--weight-format", "int4", "--sym", "--group-size", "128", "--ratio", "1.0"]
"""optimum-cli's weight arguments: the form of OpenVINO's published int4 models."""

# Qwen2.5's special and added tokens after its 151,643 ordinary ids, in id order; True = special.
QWEN_SPECIALS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True),
    ("<|box_end|>", True), ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True),
    ("<|vision_end|>", True), ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False),
    ("<|fim_prefix|>", True), ("<|fim_middle|>", True), ("<|fim_suffix|>", True), ("<|fim_pad|>", True),
    ("<|repo_name|>", True), ("<|file_sep|>", True),
]
QWEN_ORDINARY = 151_643
"""Qwen2.5's ordinary (BPE) ids: 0..151642; the specials follow."""

SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-1.5b-shape": {
        "template": "qwen2_5.jinja",
        "ordinary_tokens": QWEN_ORDINARY,
        "specials": QWEN_SPECIALS,
        "tokenizer": {"eos": "<|im_end|>", "pad": "<|endoftext|>", "bos": None, "unk": None,
                      "model_max_length": 131072},
        "gen_eos": ["<|im_end|>", "<|endoftext|>"],
        # Qwen2.5-1.5B-Instruct's config.json (the architecture's numbers)
        "config": {
            "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": 151936, "hidden_size": 1536, "intermediate_size": 8960,
            "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
            "hidden_act": "silu", "max_position_embeddings": 32768, "max_window_layers": 21,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "sliding_window": 32768,
            "use_sliding_window": False, "tie_word_embeddings": True, "initializer_range": 0.02,
            "bos_token_id": 151643, "eos_token_id": 151645, "attention_dropout": 0.0,
        },
    },
}

def cache_models_dir() -> Path:
    """Where built models go: ``$AGENTKV_CACHE_DIR/models``, else ``$XDG_CACHE_HOME/agentkv/models``,
    else ``~/.cache/agentkv/models`` (the runtime's cache dir on Linux): ``cache_models_dir() / name``."""
    root = os.environ.get("AGENTKV_CACHE_DIR")
    if root:
        return Path(root).expanduser() / "models"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "agentkv" / "models"


def recipe_hash(name: str) -> str:
    """A hash of what decides the built files (shape, tokenizer layout, export arguments, seed):
    a manifest with another hash is stale. ``recipe_hash("qwen2.5-1.5b-shape")``."""
    recipe = {"shape": SHAPES[name], "export": EXPORT_ARGS, "seed": SEED, "version": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def built_manifest(directory: Path, name: str) -> dict[str, Any] | None:
    """The manifest of a complete build of ``name`` in ``directory``, or None when there is none or
    it is of another recipe: ``built_manifest(cache_models_dir() / name, name)``."""
    path = directory / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
    return manifest if manifest.get("recipe") == recipe_hash(name) else None


def filler_pieces(count: int, taken: set[str], seed: int = SEED) -> list[str]:
    """``count`` distinct byte-level word pieces (lowercase letters, half with the ``Ġ`` space
    marker) not in ``taken``, the same for the same seed: the padding of the vocabulary."""
    rng = random.Random(seed)
    pieces: list[str] = []
    seen = set(taken)
    while len(pieces) < count:
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 9)))
        piece = ("\u0120" + word) if rng.random() < 0.5 else word
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    return pieces


def sized_tokenizer(spec: dict[str, Any]) -> Any:
    """A byte-level BPE trained as the zoo's (build_zoo.train_tokenizer), its vocabulary padded with
    filler pieces to ``spec["ordinary_tokens"]`` ids, then the specials at their real ids."""
    from build_zoo import train_tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    trained = train_tokenizer({"vocab": "bytelevel", "specials": [], "added": []})
    state = json.loads(trained.to_str())
    vocab: dict[str, int] = dict(sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1]))
    vocab = {token: index for index, token in enumerate(vocab)}
    for piece in filler_pieces(spec["ordinary_tokens"] - len(vocab), set(vocab)):
        vocab[piece] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    for token, special in spec["specials"]:  # one at a time: each takes the next id
        (tok.add_special_tokens if special else tok.add_tokens)([token])
    for offset, (token, _) in enumerate(spec["specials"]):
        assert tok.token_to_id(token) == spec["ordinary_tokens"] + offset, token
    return tok


def save_random_model(name: str, hf_dir: Path) -> dict[str, Any]:
    """Save ``name``'s random-weight transformers model (bf16), tokenizer and generation config in
    ``hf_dir``; return its parameter count and the seconds it took."""
    import torch
    from build_zoo import hf_tokenizer
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    spec = SHAPES[name]
    started = time.perf_counter()
    random.seed(SEED)
    torch.manual_seed(SEED)
    tok = sized_tokenizer(spec)
    hf = hf_tokenizer(tok, {"template": spec["template"], **spec["tokenizer"]})
    hf.model_max_length = spec["tokenizer"]["model_max_length"]
    config_kwargs = {k: v for k, v in spec["config"].items() if k not in ("architectures", "model_type")}
    config = AutoConfig.for_model(spec["config"]["model_type"], **config_kwargs)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.eval()
    ids = {token: tok.token_to_id(token) for token, _ in spec["specials"]}
    model.generation_config = GenerationConfig(
        bos_token_id=spec["config"]["bos_token_id"], eos_token_id=[ids[t] for t in spec["gen_eos"]],
        pad_token_id=ids[spec["tokenizer"]["pad"]])
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(hf_dir, safe_serialization=True)
    hf.save_pretrained(hf_dir)
    del model
    gc.collect()
    return {"parameters": parameters, "tokenizer_size": tok.get_vocab_size(),
            "init_s": round(time.perf_counter() - started, 1)}


@contextlib.contextmanager
def build_lock(models_dir: Path, name: str) -> Iterator[None]:
    """Hold ``models_dir/.<name>.lock`` (flock) for the build: a second builder waits, then finds
    the manifest."""
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{name}.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build(name: str, target: Path) -> dict[str, Any]:
    """Build ``name`` into ``target`` unless a manifest of its recipe is there; return the manifest:
    ``build("qwen2.5-1.5b-shape", cache_models_dir() / "qwen2.5-1.5b-shape")``."""
    from build_zoo import export_openvino

    with build_lock(target.parent, name):
        done = built_manifest(target, name)
        if done is not None:
            print(f"{name}: already built in {target}", flush=True)
            return done
        started = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".build-{name}-", dir=target.parent))
        try:
            hf_dir, out = work / "hf", work / "ir"
            made = save_random_model(name, hf_dir)
            init_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            export_started = time.perf_counter()
            export_openvino(hf_dir, out, SHAPES[name]["template"], EXPORT_ARGS)
            export_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
            manifest = {
                "name": name, "recipe": recipe_hash(name), "config": SHAPES[name]["config"],
                "export_args": EXPORT_ARGS, **made,
                "export_s": round(time.perf_counter() - export_started, 1),
                "build_s": round(time.perf_counter() - started, 1),
                "peak_rss_init_bytes": init_rss, "peak_rss_export_bytes": export_rss,
                "bytes": sum(p.stat().st_size for p in out.iterdir()),
                "versions": _versions(),
            }
            (out / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
            _replace(out, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    print(f"{name}: {manifest['parameters'] / 1e9:.2f} B parameters, {manifest['bytes'] / 1e6:.0f} MB in "
          f"{target}; {manifest['build_s']:.0f} s, peak RSS {export_rss / 2**30:.1f} GiB (export)", flush=True)
    return manifest


def _replace(built: Path, target: Path) -> None:
    """Move ``built`` to ``target``; a stale ``target`` (another recipe) is renamed away first."""
    if target.exists():
        stale = target.with_name(f".stale-{target.name}-{os.getpid()}")
        os.rename(target, stale)
        shutil.rmtree(stale, ignore_errors=True)
    os.rename(built, target)


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {pkg: version(pkg) for pkg in ("torch", "transformers", "optimum-intel", "nncf", "openvino")}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", choices=sorted(SHAPES), nargs="?", default="qwen2.5-1.5b-shape")
    parser.add_argument("--out", type=Path, help="directory to build into (default: the cache's models/<name>)")
    parser.add_argument("--check", action="store_true",
                        help="build nothing: exit 0 when the model is built (stdlib only: any python3), else 1")
    args = parser.parse_args(argv)
    target = (args.out or cache_models_dir() / args.name).expanduser().resolve()
    if built_manifest(target, args.name) is not None:  # NOTE: before build()'s torch imports (~10 s)
        print(f"{args.name}: built in {target}", flush=True)
        return
    if args.check:
        print(f"{args.name}: not built in {target}", flush=True)
        raise SystemExit(1)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    build(args.name, target)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # build_zoo, beside this file
    main(sys.argv[1:])
