"""Grammar-constrained decoding: llguidance token masks built from the GGUF vocabulary.

The engine asks the constraint, per step, which tokens may come next; llguidance computes it
from a Lark grammar (with inline ``%json`` schemas) or a JSON-schema grammar::

    meta = resolve_model(None).gguf_metadata()
    factory = ConstraintFactory(meta["tokenizer.ggml.tokens"], eos_token_id=2, vocab_size=49152,
                                token_types=meta["tokenizer.ggml.token_type"], encode=tokenizer.encode)
    result = await session.generate(ids, cfg, constraint=factory(grammar))

EOS is allowed exactly when the grammar accepts; ``is_finished`` once nothing else may follow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from functools import lru_cache

import llguidance
import llguidance.numpy as llg_numpy
import numpy as np
from cachetools import LRUCache

from agentkv.errors import ConstraintError

_CONTROL = 3
_USER_DEFINED = 4
"""GGUF ``tokenizer.ggml.token_type`` values of special tokens (llama.cpp's convention)."""


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


def _special_ids(
    tokens: Sequence[str], token_types: Sequence[int] | None, eos_ids: Sequence[int]
) -> list[int]:
    """Ids of control tokens: from GGUF token types when given, else ``<|...|>`` names and EOS."""
    special = set(eos_ids)
    for index, token in enumerate(tokens):
        if token_types is not None:
            kind = token_types[index]
            looks_special = token.startswith("<") and token.endswith(">")
            if kind == _CONTROL or (kind == _USER_DEFINED and looks_special):
                special.add(index)
        elif token.startswith("<|") and token.endswith("|>"):
            special.add(index)
    return sorted(special)


class _GgufVocabulary:
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
) -> llguidance.LLTokenizer:
    """An ``LLTokenizer`` for a GPT-2 byte-level GGUF vocabulary (~0.2 s: build it once).

    ``tokens`` is ``tokenizer.ggml.tokens``; ``token_types`` (``tokenizer.ggml.token_type``) marks
    special tokens such as ``<|im_end|>``. ``encode`` is the model's text → ids (used on text the
    grammar forces); without it llguidance's greedy tokenisation stands in.
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
    decoder = _gpt2_byte_decoder()
    token_bytes = [_token_bytes(token, decoder) for token in tokens]
    token_bytes += [b""] * (vocab_size - len(tokens))  # ids past the vocabulary: never allowed
    vocabulary = _GgufVocabulary(token_bytes, eos_ids[0], _special_ids(tokens, token_types, eos_ids), encode)
    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(vocabulary), eos_token=eos_ids)
    vocabulary.greedy_encode = tokenizer.greedy_tokenize
    return tokenizer


class GrammarConstraint:
    """One generation's grammar state (implements ``agentkv.engine.base.TokenConstraint``).

    ``mask = c.allowed_mask(); c.advance(token); c.is_finished()``
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
        cache_size: int = 32,
    ) -> None:
        self.vocab_size = vocab_size
        self.tokenizer = llg_tokenizer_from_gguf_vocab(
            tokens, eos_token_id=eos_token_id, vocab_size=vocab_size, token_types=token_types, encode=encode
        )
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
