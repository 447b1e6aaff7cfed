"""Build the model zoo: tiny random-weight models of the common instruct families, exported as users' IRs are.

Run it in its own venv (``make zoo``: torch, transformers and optimum-intel live only there, never in
``.venv``)::

    .zoo-venv/bin/python scripts/build_zoo.py              # every family
    .zoo-venv/bin/python scripts/build_zoo.py qwen2_5 gemma3  # some

Per family, deterministically (fixed seeds, one thread):

1. a small vocabulary trained with ``tokenizers`` on the repo's own English text (tests/data/zoo/
   corpus.txt: a fixed copy of README.md), plus the family's real special tokens. Byte-level BPE
   (GPT-2 style) for every family but Gemma 3, which gets a SentencePiece-style BPE (``▁`` for
   spaces, ``<0xNN>`` byte fallback) as the real Gemma vocabulary is;
2. a tiny random-weight model from a transformers config of the family's real architecture
   (hidden 64, head_dim 16, few layers), its weights rounded to fp16 so that the fp16 export and the
   fp32 torch reference hold the same numbers;
3. saved with its tokenizer, the family's real chat template (tests/data/templates/) in
   tokenizer_config.json and a generation_config.json with the family's real EOS list;
4. exported with ``optimum-cli export openvino --task text-generation-with-past --weight-format fp16``
   into tests/data/zoo/<family>/;
5. reference.json: a short conversation rendered by transformers' ``apply_chat_template``
   (add_generation_prompt), its ids, the torch fp32 greedy continuation (16 tokens, EOS ignored),
   per step the top-2 logit gap, the last prompt position's top-8 ids, logits and log-probabilities,
   the template's next-turn markup after an answer, and a probe text's ids (byte fallback);
6. then ``zoo_layouts.write_layouts``: Mistral Nemo a second time in transformers 4.57 + optimum-intel's
   own layout (``chat_template.jinja``, no template in tokenizer_config.json) as mistral_nemo_jinja/.

Versions, sizes and what the runtime does with each model: tests/data/zoo/README.md.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np
import torch
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)
from zoo_layouts import write_layouts  # scripts/, beside this file

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "tests" / "data" / "templates"
ZOO = ROOT / "tests" / "data" / "zoo"
CORPUS = ZOO / "corpus.txt"
SEED = 1234
VOCAB_SIZE = 3000
NEW_TOKENS = 16
TOP_K = 8

SYSTEM = "You are a concise assistant."
USER = "What does the runtime keep between the turns of a conversation?"
USER_2 = "And what happens when the window is full?"
PROBE = "Caf\u00e9 \u2615 costs 3\u20ac \u2014 na\u00efve?  Tabs\tand\nnew lines."
"""Text outside the vocabulary's training text: SentencePiece byte fallback (<0xNN>), byte-level BPE's
rare bytes, runs of spaces, tabs, newlines."""

# Files of an optimum-intel export that users' directories have and agentkv may read; the rest
# (special_tokens_map.json, a separate chat_template.jinja: the template goes into
# tokenizer_config.json as in the families' published repos) are dropped.
KEEP = {
    "openvino_model.xml", "openvino_model.bin",
    "openvino_tokenizer.xml", "openvino_tokenizer.bin",
    "openvino_detokenizer.xml", "openvino_detokenizer.bin",
    "config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
}

COMMON: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16, "initializer_range": 0.1,
                          "max_position_embeddings": 4096}


def _family(**spec: Any) -> dict[str, Any]:
    return spec


# family: template file, special tokens (in id order, first ids), the tokenizer's bos/eos/pad/unk,
# generation_config's EOS list (by token), the vocabulary style, the architecture.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2_5": _family(
        template="qwen2_5.jinja",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<tool_call>", "</tool_call>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        gen_eos=["<|im_end|>", "<|endoftext|>"],
        vocab="bytelevel",
        config=lambda v, ids: Qwen2Config(
            vocab_size=v, num_hidden_layers=2, rope_theta=1e6, use_sliding_window=False,
            tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|endoftext|>"],
            **COMMON),
        system=True,
    ),
    "qwen3": _family(
        template="qwen3.jinja",
        specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        added=["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"],
        bos=None, eos="<|im_end|>", pad="<|endoftext|>", unk=None,
        gen_eos=["<|im_end|>", "<|endoftext|>"],
        vocab="bytelevel",
        config=lambda v, ids: Qwen3Config(
            vocab_size=v, num_hidden_layers=2, rope_theta=1e6, use_sliding_window=False,
            tie_word_embeddings=True, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
            **COMMON),
        system=True,
    ),
    "llama3_1": _family(
        template="llama3_1.jinja",
        specials=["<|begin_of_text|>", "<|end_of_text|>", "<|finetune_right_pad_id|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
        added=[],
        bos="<|begin_of_text|>", eos="<|eot_id|>", pad=None, unk=None,
        gen_eos=["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
        vocab="bytelevel",
        config=lambda v, ids: LlamaConfig(
            vocab_size=v, num_hidden_layers=2,
            rope_theta=5e5, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 1024},
            tie_word_embeddings=False, bos_token_id=ids["<|begin_of_text|>"],
            eos_token_id=[ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]], **COMMON),
        system=True,
    ),
    "phi3_5": _family(
        template="phi3_5.jinja",
        specials=["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
        added=[],
        bos="<s>", eos="<|endoftext|>", pad="<|endoftext|>", unk="<unk>",
        gen_eos=["<|end|>", "<|assistant|>", "<|endoftext|>"],
        vocab="bytelevel",
        config=lambda v, ids: Phi3Config(
            vocab_size=v, num_hidden_layers=2, partial_rotary_factor=0.75, rope_theta=1e4,
            tie_word_embeddings=False, bos_token_id=ids["<s>"], eos_token_id=ids["<|endoftext|>"],
            pad_token_id=ids["<|endoftext|>"], **COMMON),
        system=True,
    ),
    "gemma2": _family(
        template="gemma2.jinja",
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
        added=[],
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        gen_eos=["<eos>", "<end_of_turn>"],
        vocab="bytelevel",
        config=lambda v, ids: Gemma2Config(
            vocab_size=v, num_hidden_layers=2, query_pre_attn_scalar=16, sliding_window=32,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
            rope_theta=1e4, tie_word_embeddings=True,
            bos_token_id=ids["<bos>"], eos_token_id=ids["<eos>"], pad_token_id=ids["<pad>"],
            hidden_activation="gelu_pytorch_tanh", **COMMON),
        system=False,  # the template raises on a system role
    ),
    "gemma3": _family(
        template="gemma3.jinja",
        specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"],
        added=[],
        bos="<bos>", eos="<eos>", pad="<pad>", unk="<unk>",
        gen_eos=["<eos>", "<end_of_turn>"],
        vocab="sentencepiece",
        config=lambda v, ids: Gemma3TextConfig(
            vocab_size=v, num_hidden_layers=6, query_pre_attn_scalar=16, sliding_window=32,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            rope_local_base_freq=1e4, rope_theta=1e6,
            tie_word_embeddings=True, bos_token_id=ids["<bos>"], eos_token_id=[ids["<eos>"], ids["<end_of_turn>"]],
            pad_token_id=ids["<pad>"], hidden_activation="gelu_pytorch_tanh", **COMMON),
        system=True,
    ),
    "mistral_nemo": _family(
        template="mistral_nemo.jinja",
        specials=["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"],
        added=[],
        bos="<s>", eos="</s>", pad=None, unk="<unk>",
        gen_eos=["</s>"],
        vocab="bytelevel",
        # Nemo's heads are wider than the hidden size (32 x 128 = 4096 < 5120): here 6 x 16 = 96 > 64
        config=lambda v, ids: MistralConfig(
            vocab_size=v, num_hidden_layers=2, sliding_window=None,
            rope_theta=1e6, tie_word_embeddings=False,
            bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
            **{**COMMON, "num_attention_heads": 6, "num_key_value_heads": 2}),
        system=True,
    ),
}


def corpus() -> list[str]:
    """The vocabulary's training text: tests/data/zoo/corpus.txt (the project's README.md at
    commit ce81ce4, kept fixed so that later edits to the repo do not change the zoo), plus the
    reference conversation's words."""
    text = CORPUS.read_text(encoding="utf-8") + f"\n{SYSTEM}\n{USER}\n{USER_2}\n"
    return [line for line in text.splitlines() if line.strip()]


def train_tokenizer(spec: dict[str, Any]) -> Tokenizer:
    lines = corpus()
    if spec["vocab"] == "bytelevel":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=spec["specials"],
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(lines, trainer)
        tok.add_tokens(spec["added"])  # ordinary added tokens, as Qwen's <tool_call> is
        return tok
    # SentencePiece-style (as Gemma's tokenizer.json): spaces become ▁, no pre-tokenizer (a
    # Split("▁", merged_with_next) one was tried: openvino-tokenizers 2026.4.1 then drops one space
    # of "?  Tabs", transformers keeps it), unknown characters fall back to <0xNN> byte tokens.
    base = Tokenizer(models.BPE(unk_token=spec["unk"]))
    base.normalizer = normalizers.Replace(" ", "\u2581")
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - 256, min_frequency=2, special_tokens=spec["specials"],
                                  show_progress=False)
    base.train_from_iterator(lines, trainer)
    state = json.loads(base.to_str())
    trained = state["model"]["vocab"]
    vocab: dict[str, int] = {}
    for token in spec["specials"]:
        vocab[token] = len(vocab)
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained.items(), key=lambda kv: kv[1]):
        if token not in vocab:
            vocab[token] = len(vocab)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in state["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=spec["unk"], byte_fallback=True,
                               fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens(spec["specials"])
    return tok


def hf_tokenizer(tok: Tokenizer, spec: dict[str, Any]) -> PreTrainedTokenizerFast:
    template = (TEMPLATES / spec["template"]).read_text(encoding="utf-8")
    kwargs = {k + "_token": spec[k] for k in ("bos", "eos", "pad", "unk") if spec[k] is not None}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, clean_up_tokenization_spaces=False,
                                 model_max_length=4096, **kwargs)
    return hf


def conversation(spec: dict[str, Any]) -> list[dict[str, str]]:
    if spec["system"]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    return [{"role": "user", "content": USER}]


def reference(model: torch.nn.Module, hf: PreTrainedTokenizerFast, spec: dict[str, Any]) -> dict[str, Any]:
    messages = conversation(spec)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    tokens = list(ids)
    generated: list[int] = []
    gaps: list[float] = []
    top: dict[str, list[Any]] = {}
    with torch.no_grad():
        for step in range(NEW_TOKENS):
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
            values, order = torch.topk(logits, TOP_K)
            if step == 0:
                logprobs = torch.log_softmax(logits, dim=-1)[order]
                top = {"ids": [int(i) for i in order], "values": [float(v) for v in values],
                       "logprobs": [float(v) for v in logprobs]}
            gaps.append(float(values[0] - values[1]))
            generated.append(int(order[0]))
            tokens.append(int(order[0]))
    # the second turn: what the template puts after the first answer (its end-of-turn markup, the
    # next user turn and the generation prompt), cut at a marker standing for the answer
    marker = "ANSWER_MARKER_0"
    second = messages + [{"role": "assistant", "content": marker}, {"role": "user", "content": USER_2}]
    rendered = hf.apply_chat_template(second, add_generation_prompt=True, tokenize=False)
    suffix = rendered[rendered.index(marker) + len(marker):]
    return {
        "probe_text": PROBE,
        "probe_ids": [int(i) for i in hf(PROBE, add_special_tokens=False)["input_ids"]],
        "messages": messages,
        "second_user": USER_2,
        "second_turn_suffix_text": suffix,
        "second_turn_suffix_ids": [int(i) for i in hf(suffix, add_special_tokens=False)["input_ids"]],
        "prompt_text": text,
        "prompt_ids": [int(i) for i in ids],
        "greedy_ids": generated,
        "greedy_text": hf.decode(generated, skip_special_tokens=False),
        "top2_gaps": gaps,
        "last_logits_top8": top,
    }


def export_openvino(hf_dir: Path, out: Path, template: str, weight_args: list[str]) -> None:
    """Export the transformers model saved in ``hf_dir`` with ``optimum-cli export openvino`` (the
    optimum-cli beside this interpreter) into ``out``, put the family's chat template (a file of
    tests/data/templates/) into tokenizer_config.json as the published repos have it, and keep only
    the files of ``KEEP``::

        export_openvino(work / "qwen2_5", ZOO / "qwen2_5", "qwen2_5.jinja", ["--weight-format", "fp16"])
    """
    cli = Path(sys.executable).with_name("optimum-cli")
    subprocess.run([str(cli), "export", "openvino", "--model", str(hf_dir), "--task", "text-generation-with-past",
                    *weight_args, str(out)], check=True)
    config_path = out / "tokenizer_config.json"
    tok_config = json.loads(config_path.read_text(encoding="utf-8"))
    tok_config["chat_template"] = (TEMPLATES / template).read_text(encoding="utf-8")
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    for path in out.iterdir():
        if path.name not in KEEP:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()


def build(name: str, spec: dict[str, Any], out: Path, work: Path) -> dict[str, Any]:
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    tok = train_tokenizer(spec)
    hf = hf_tokenizer(tok, spec)
    ids = {t: tok.token_to_id(t) for t in spec["specials"] + spec["added"]}
    config = spec["config"](tok.get_vocab_size(), ids)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # the export stores fp16: round here so torch and the IR hold the same weights
        for param in model.parameters():
            param.copy_(param.half().float())
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=ids.get(spec["bos"]) if spec["bos"] else None,
        eos_token_id=[ids[t] for t in spec["gen_eos"]],
        pad_token_id=ids.get(spec["pad"]) if spec["pad"] else None,
    )
    hf_dir = work / name
    model.save_pretrained(hf_dir, safe_serialization=True)
    hf.save_pretrained(hf_dir)
    ref = reference(model, hf, spec)

    if out.exists():
        shutil.rmtree(out)
    export_openvino(hf_dir, out, spec["template"], ["--weight-format", "fp16"])
    ref["family"] = name
    ref["architecture"] = type(model).__name__
    ref["vocab"] = spec["vocab"]
    ref["vocab_size"] = tok.get_vocab_size()
    ref["eos_token_ids"] = [ids[t] for t in spec["gen_eos"]]
    (out / "reference.json").write_text(json.dumps(ref, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{name}: {type(model).__name__}, vocab {tok.get_vocab_size()}, {size / 1e6:.2f} MB", flush=True)
    return {"family": name, "bytes": size}


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    names = argv or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise SystemExit(f"unknown families {unknown}; known: {', '.join(FAMILIES)}")
    with tempfile.TemporaryDirectory(prefix="agentkv-zoo-") as work:
        for name in names:
            build(name, FAMILIES[name], ZOO / name, Path(work))
    write_layouts(names)


if __name__ == "__main__":
    main(sys.argv[1:])
