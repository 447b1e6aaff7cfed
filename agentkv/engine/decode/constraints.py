"""Grammar-constrained decoding: llguidance token masks built from the model's vocabulary.

The vocabulary comes from the Hugging Face ``tokenizer.json`` an IR directory ships (each token's
bytes as llguidance's Rust ``tokenizers`` reads them, byte-level BPE and SentencePiece alike;
control tokens from its ``added_tokens`` ``special`` flags) or from a GGUF's
``tokenizer.ggml.tokens`` (GPT-2 byte-level or SentencePiece ``▁`` / ``<0xNN>`` tokens). The
engine asks the constraint, per step, which tokens may come next; llguidance computes it from a
Lark grammar (with inline ``%json`` schemas) or a JSON-schema grammar::

    factory = ConstraintFactory.from_tokenizer_json(Path("tokenizer.json").read_text(encoding="utf-8"),
                                                    eos_token_id=[2, 0], vocab_size=152064)
    meta = resolve_model(None).gguf_metadata()
    factory = ConstraintFactory(meta["tokenizer.ggml.tokens"], eos_token_id=2, vocab_size=49152,
                                token_types=meta["tokenizer.ggml.token_type"], encode=tokenizer.encode)
    result = await session.generate(ids, cfg, constraint=factory(grammar))

EOS is allowed exactly when the grammar accepts; ``is_finished`` once nothing else may follow.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Sequence
from functools import lru_cache

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from cachetools import LRUCache

from agentkv.errors import ConstraintError

_CONTROL = 3
"""GGUF ``tokenizer.ggml.token_type`` of control tokens (llama.cpp's convention); USER_DEFINED (4)
tokens are ordinary text that the tokenizer keeps whole (Qwen's ``<tool_call>``)."""
_SENTENCEPIECE_SPACE = "\u2581"
"""``▁``: how a SentencePiece vocabulary spells a space."""
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""A SentencePiece byte-fallback token such as ``<0x41>``: one raw byte."""


@lru_cache(maxsize=1)
def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level BPE's printable stand-in character → the byte it encodes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    decoder = {chr(byte): byte for byte in printable}
    shifted = 0
    for byte in range(256):
        if byte not in decoder.values():
            decoder[chr(256 + shifted)] = byte
            shifted += 1
    return decoder


def _token_bytes(token: str, decoder: dict[str, int]) -> bytes:
    """The bytes a GPT-2 byte-level token stands for (characters outside the map as UTF-8)."""
    if all(char in decoder for char in token):
        return bytes(decoder[char] for char in token)
    return token.encode("utf-8")


def _sentencepiece_token_bytes(token: str) -> bytes:
    """The bytes a SentencePiece token stands for: ``<0x41>`` → b"A", ``▁a`` → b" a"."""
    byte = _BYTE_TOKEN.fullmatch(token)
    if byte is not None:
        return bytes([int(byte.group(1), 16)])
    return token.replace(_SENTENCEPIECE_SPACE, " ").encode("utf-8")


def _is_sentencepiece(tokens: Sequence[str], tokenizer_model: str | None) -> bool:
    """True for a SentencePiece vocabulary: GGUF ``tokenizer.ggml.model`` "llama", or, when it
    is not given, ``<0xNN>`` byte-fallback tokens in the vocabulary."""
    if tokenizer_model is not None:
        return tokenizer_model == "llama"
    return any(_BYTE_TOKEN.fullmatch(token) for token in tokens)


def _special_ids(
    tokens: Sequence[str], token_types: Sequence[int] | None, eos_ids: Sequence[int]
) -> list[int]:
    """Ids of control tokens: GGUF CONTROL token types when given, else ``<|...|>`` names; and EOS."""
    special = set(eos_ids)
    for index, token in enumerate(tokens):
        if token_types is not None:
            if token_types[index] == _CONTROL:
                special.add(index)
        elif token.startswith("<|") and token.endswith("|>"):
            special.add(index)
    return sorted(special)


class _Vocabulary:
    """What ``llguidance.TokenizerWrapper`` wraps: token bytes, EOS, specials and an encoder."""

    def __init__(
        self,
        token_bytes: list[bytes],
        eos_token_id: int,
        special_token_ids: list[int],
        encode: Callable[[str], list[int]] | None,
    ) -> None:
        self.tokens = token_bytes
        self.eos_token_id = eos_token_id
        self.bos_token_id: int | None = None
        self.special_token_ids = special_token_ids
        # NOTE: llguidance re-tokenises the forced text at every step of a forced stretch, and a
        # call into the model's tokenizer costs ~0.3 ms; the stretches repeat across generations.
        self._encode: Callable[[str], tuple[int, ...]] | None = None
        if encode is not None:
            model_encode = encode
            self._encode = lru_cache(maxsize=4096)(lambda text: tuple(model_encode(text)))
        self.greedy_encode: Callable[[str], list[int]] | None = None
        """Set after the LLTokenizer exists: its greedy tokenizer, used when ``encode`` is None."""

    def __call__(self, text: str | bytes) -> list[int]:
        # NOTE: llguidance calls this to tokenise bytes the grammar forces; the mask then allows
        # only the first of those tokens, so the model's own BPE gives canonical tokens.
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        if self._encode is not None:
            return list(self._encode(text))
        assert self.greedy_encode is not None, "the vocabulary is used before its tokenizer exists"
        return list(self.greedy_encode(text))


def llg_tokenizer_from_gguf_vocab(
    tokens: Sequence[str],
    *,
    eos_token_id: int | Sequence[int],
    vocab_size: int,
    token_types: Sequence[int] | None = None,
    encode: Callable[[str], list[int]] | None = None,
    tokenizer_model: str | None = None,
) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` for a GGUF vocabulary (~0.2 s: build it once).

    ``tokens`` is ``tokenizer.ggml.tokens``; ``token_types`` (``tokenizer.ggml.token_type``) marks
    control tokens such as ``<|im_end|>``. ``tokenizer_model`` (``tokenizer.ggml.model``) says
    how tokens spell bytes: "gpt2" (byte-level) or "llama" (SentencePiece: ``▁``, ``<0xNN>``);
    when None, a vocabulary with ``<0xNN>`` tokens is SentencePiece. ``encode`` is the model's
    text → ids (used on text the grammar forces); without it llguidance's greedy tokenisation
    stands in.
    ``llg_tokenizer_from_gguf_vocab(meta["tokenizer.ggml.tokens"], eos_token_id=2, vocab_size=49152)``
    """
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    if not eos_ids or len(tokens) > vocab_size or any(not 0 <= i < vocab_size for i in eos_ids):
        raise ConstraintError(
            f"vocabulary of {len(tokens)} tokens, eos {eos_ids}, vocab_size {vocab_size} do not fit; "
            "pass the model's logits width as vocab_size and EOS ids inside it"
        )
    if token_types is not None and len(token_types) != len(tokens):
        raise ConstraintError("token_types must have one entry per token (tokenizer.ggml.token_type)")
    if _is_sentencepiece(tokens, tokenizer_model):
        token_bytes = [_sentencepiece_token_bytes(token) for token in tokens]
    else:
        decoder = _gpt2_byte_decoder()
        token_bytes = [_token_bytes(token, decoder) for token in tokens]
    token_bytes += [b""] * (vocab_size - len(tokens))  # ids past the vocabulary: never allowed
    return _llg_tokenizer(token_bytes, eos_ids, _special_ids(tokens, token_types, eos_ids), encode)


def llg_tokenizer_from_tokenizer_json(
    tokenizer_json: str,
    *,
    eos_token_id: int | Sequence[int],
    vocab_size: int,
    encode: Callable[[str], list[int]] | None = None,
) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` from a Hugging Face ``tokenizer.json`` text (~30 ms for 3k tokens).

    Each token's bytes come from llguidance's reading of the file (the Rust ``tokenizers``
    library: byte-level BPE and SentencePiece alike); control tokens are the ``added_tokens``
    flagged ``special`` (llguidance alone would make every added token special, Qwen's ordinary
    ``<tool_call>`` included), plus EOS. Ids from the tokenizer's size up to ``vocab_size`` (the
    logits' width) are never allowed. ``encode`` is the model's text → ids for forced text
    (default: the tokenizer.json's own tokenizer).
    ``llg_tokenizer_from_tokenizer_json(text, eos_token_id=[2, 0], vocab_size=152064)``
    """
    eos_ids = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    try:
        reader = llguidance.LLTokenizer(tokenizer_json, eos_token=eos_ids or None, slices=[])
        added = json.loads(tokenizer_json).get("added_tokens") or []
    except ValueError as error:  # json.JSONDecodeError is a ValueError too
        raise ConstraintError(
            f"llguidance cannot read this tokenizer.json: {error}; pass the model's own tokenizer.json"
        ) from error
    if not eos_ids or reader.vocab_size > vocab_size or any(not 0 <= i < vocab_size for i in eos_ids):
        raise ConstraintError(
            f"tokenizer.json of {reader.vocab_size} tokens, eos {eos_ids}, vocab_size {vocab_size} do not "
            "fit; pass the model's logits width as vocab_size and EOS ids inside it"
        )
    token_bytes = [reader.decode_bytes([i]) for i in range(reader.vocab_size)]
    token_bytes += [b""] * (vocab_size - reader.vocab_size)  # ids past the vocabulary: never allowed
    special = sorted({int(token["id"]) for token in added if token.get("special")} | set(eos_ids))
    return _llg_tokenizer(token_bytes, eos_ids, special, encode or reader.tokenize_str)


def _llg_tokenizer(
    token_bytes: list[bytes], eos_ids: list[int], special_ids: list[int], encode: Callable[[str], list[int]] | None
) -> llguidance.LLTokenizer:
    """The ``LLTokenizer`` over one vocabulary (its bytes per id, EOS, control ids, encoder)."""
    vocabulary = _Vocabulary(token_bytes, eos_ids[0], special_ids, encode)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=eos_ids)
    vocabulary.greedy_encode = tokenizer.greedy_tokenize
    return tokenizer


class GrammarConstraint:
    """One generation's grammar state (implements ``agentkv.engine.base.TokenConstraint``).

    ``mask = c.allowed_mask(); c.advance(token); c.is_finished(); c.forced_tokens()``
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bits = llg_numpy.allocate_token_bitmask(1, vocab_size)  # int32 [1, ceil(vocab/32)]
        self._mask: np.ndarray | None = None  # bool [vocab], cached until the next advance

    def allowed_mask(self) -> np.ndarray:
        """Bool ``[vocab_size]``: the tokens the grammar allows next (EOS iff it accepts)."""
        if self._mask is None:
            self._raise_if_error()
            llg_numpy.fill_next_token_bitmask(self._matcher, self._bits)
            # NOTE: token i is bit i % 32 of word i // 32; little-endian words make that bit
            # i % 8 of byte i // 8, which is what bitorder="little" unpacks.
            bits = np.unpackbits(self._bits.view(np.uint8), count=self._vocab_size, bitorder="little")
            self._mask = bits.view(np.bool_)
        return self._mask

    def advance(self, token_id: int) -> None:
        """Consume ``token_id``; raises ``ConstraintError`` if the grammar does not allow it."""
        self._raise_if_error()
        if not 0 <= token_id < self._vocab_size or not self._matcher.consume_token(token_id):
            raise ConstraintError(
                f"token {token_id} is not allowed by the grammar here "
                f"({self._matcher.get_error() or 'outside the vocabulary'}); "
                "sample only among allowed_mask() and build the constraint from the model's vocabulary"
            )
        self._mask = None

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar forces next, in order: each is the only token its mask allows
        (llguidance's fast-forward tokens; empty when the model must choose). No state change."""
        self._raise_if_error()
        return [int(token) for token in self._matcher.compute_ff_tokens()]

    def is_finished(self) -> bool:
        """True once the grammar has accepted and no token but EOS may follow."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    def is_accepting(self) -> bool:
        """True when the text so far is a complete sentence of the grammar (EOS allowed)."""
        return self._matcher.is_accepting()

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"the grammar constraint is in an error state: {self._matcher.get_error()}")


class ConstraintFactory:
    """Builds the llguidance tokenizer once and a fresh ``GrammarConstraint`` per generation.

    Compiled grammars are cached (LRU): a repeated grammar costs a matcher copy (~µs), not a
    compile (~ms). ``constraint = factory(tool_call_grammar(tools, "required"))``
    """

    def __init__(
        self,
        tokens: Sequence[str],
        *,
        eos_token_id: int | Sequence[int],
        vocab_size: int,
        token_types: Sequence[int] | None = None,
        encode: Callable[[str], list[int]] | None = None,
        tokenizer_model: str | None = None,
        cache_size: int = 32,
    ) -> None:
        """From a GGUF vocabulary (arguments as ``llg_tokenizer_from_gguf_vocab``)."""
        self._start(llg_tokenizer_from_gguf_vocab(
            tokens, eos_token_id=eos_token_id, vocab_size=vocab_size, token_types=token_types,
            encode=encode, tokenizer_model=tokenizer_model,
        ), cache_size)

    @classmethod
    def from_tokenizer_json(
        cls,
        tokenizer_json: str,
        *,
        eos_token_id: int | Sequence[int],
        vocab_size: int,
        encode: Callable[[str], list[int]] | None = None,
        cache_size: int = 32,
    ) -> ConstraintFactory:
        """From a Hugging Face ``tokenizer.json`` text (arguments as
        ``llg_tokenizer_from_tokenizer_json``)::

            ConstraintFactory.from_tokenizer_json(text, eos_token_id=[2, 0], vocab_size=152064)
        """
        factory = cls.__new__(cls)
        factory._start(
            llg_tokenizer_from_tokenizer_json(
                tokenizer_json, eos_token_id=eos_token_id, vocab_size=vocab_size, encode=encode
            ),
            cache_size,
        )
        return factory

    def _start(self, tokenizer: llguidance.LLTokenizer, cache_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size: int = tokenizer.vocab_size
        self._compiled: LRUCache[str, llguidance.LLMatcher] = LRUCache(maxsize=cache_size)
        self._lock = threading.Lock()

    def __call__(self, grammar: str) -> GrammarConstraint:
        """A constraint for ``grammar`` (Lark text, or llguidance's JSON grammar such as
        ``llguidance.grammar_from("json_schema", ...)``); raises ``ConstraintError`` if it does
        not compile, with llguidance's message."""
        with self._lock:
            pristine = self._compiled.get(grammar)  # a hit makes it the most recently used
            if pristine is None:
                pristine = self._compile(grammar)
                self._compiled[grammar] = pristine  # beyond cache_size, the least recently used goes
            return GrammarConstraint(pristine.deep_copy(), self.vocab_size)

    def _compile(self, grammar: str) -> llguidance.LLMatcher:
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        except (ValueError, RuntimeError) as error:
            raise ConstraintError(f"the grammar does not compile: {error}; fix its Lark syntax") from error
        if matcher.is_error():
            raise ConstraintError(
                f"the grammar does not compile: {matcher.get_error()}; fix it (Lark syntax with %json "
                "schemas: https://github.com/guidance-ai/llguidance/blob/main/docs/syntax.md)"
            )
        return matcher
