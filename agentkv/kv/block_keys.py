"""Block keys: the content address of each full block of a token log's KV, a chain digest that is
the same on every process and host and changes with anything that changes the KV.

A ``KVNamespace`` says what makes two KVs of the same tokens bit-identical: the tenant salt, the
model fingerprint, the KV layout and precision, the numerics class (the plugin's compute numerics
and the canonical prefill chunk size, ``kv/chunking.py``) and the block size. Its ``chain`` keys
each full block by blake2b over the parent block's key, the block's token ids and where the
computation was cut inside it; the first block's parent is the namespace's own digest::

    space = KVNamespace(salt="tenant-a", fingerprint=engine.fingerprint, layout="paged",
                        precision="f16", numerics=str(engine.numerics), chunk_size=256, block_size=32)
    chain = space.chain(tokens, cuts=[40, 41])   # one key per full block + the partial tail
    chain.keys[0]                                 # 32 hex digits: a file name, an S3 object key
    n = leading_run(chain.keys, tier.has)         # the blocks a tier can give back, in order
    chain.tokens_in(n)                            # how many tokens those blocks hold

Stable: the bytes digested are int64 little-endian ids (``digest.int64_bytes``) and sorted-key
JSON of the namespace, never Python's ``hash()`` (randomised per process: LMCache #1842). Every
field of the namespace is in every key, the salt included: a persisted tier shared by tenants can
never hand one tenant's KV to another (sglang #37160).

**Cuts.** Where a prefill is cut changes the KV's bits wherever the numerics depend on chunking
(bf16 compute, dynamic quantisation: any two chunkings differ; even f32, a one-token decode step
differs from a multi-token prefill). ``chain(tokens)`` keys the KV a canonical prefill of
``tokens`` computes: cut only at the absolute multiples of ``chunk_size``. Any other cut of the
pass that made the KV — a registered prefix boundary, the start of a turn fed after earlier KV,
each decoded token (a pass of its own: cuts at ``p`` and ``p + 1``) — is passed in ``cuts``; a cut
at position ``p`` goes into the key of the block holding token ``p`` (``p // block_size``), so it
changes that key and every later one and none before. That assumes where a pass ends does not
change the KV of the tokens it computed, only where it began does (causal attention; measured on
the paged form at f32: any multi-token chunking equals one pass; not yet under bf16 compute,
which the store's exactness tests cover). Multiples of ``chunk_size``, 0 and ``len(tokens)`` cut nothing new and
are ignored, so passing every cut of ``chunk_spans`` gives the same keys as passing only the
others.

**The partial tail is kept with the session's record, not content-addressed.** The last
``len(tokens) % block_size`` tokens are no block: their KV is not final (a u8 cache keyed by
channel re-quantises a block's earlier tokens as later ones join it, ``kv/u8_blocks.py``), a tail
object keyed by its tokens would be a new object every turn that no other conversation asks for
and the collector must then chase, and it costs at most ``block_size - 1`` tokens of KV to write
again with the record or to prefill again. ``Tail.digest`` lets the record check that a stored
tail still belongs to this history and namespace (it is never equal to a block key). A shared
prefix that ends inside a block (a system prompt) shares its full blocks; each conversation's
next block holds the rest of it: at most one block per conversation.
"""

from __future__ import annotations

import hashlib
import json
from bisect import bisect_left
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from functools import cached_property

import numpy as np

from agentkv.errors import UserError
from agentkv.kv.digest import int64_bytes

__all__ = ["BLOCK_MULTIPLE", "BlockChain", "KVNamespace", "Tail", "leading_run"]

BLOCK_MULTIPLE = 32
"""Every block size is a multiple of the paged engine's 32-token block (``engine/paged/graphs.py``)."""
_KEY_BYTES = 16  # 32 hex digits: 128 bits, collisions need ~2**64 blocks
_FORMAT = "agentkv.block_keys/1"  # in the namespace digest: a change of encoding changes every key
_PERSON_NAMESPACE = b"agentkv.kv-ns"  # blake2b personalisation: one per kind of digest, so a
_PERSON_BLOCK = b"agentkv.kv-block"  # namespace digest, a block key and a tail digest never coincide
_PERSON_TAIL = b"agentkv.kv-tail"
_PERSON_TOKENS = b"agentkv.kv-toks"
_CUTS_FIX = "pass the positions where the passes that computed these tokens were cut"


@dataclass(frozen=True)
class KVNamespace:
    """What makes KV of the same tokens bit-identical; every field goes into every block key.
    See the module docstring for a call."""

    salt: str
    """The tenant's salt ("" for none): tenants never share a key."""
    fingerprint: str
    """Model identity (``engine.fingerprint``: model files, KV precision, device, backend)."""
    layout: str
    """How the KV is laid out in a block (e.g. "paged", "paged u8 k=by_channel v=by_token", "stateful")."""
    precision: str
    """The KV cache's element type ("f32", "f16", "bf16", "u8")."""
    numerics: str
    """The plugin's compute numerics (``str(engine.numerics)``: compute precision, dynamic
    quantisation); with ``chunk_size``, the numerics class."""
    chunk_size: int | None
    """The canonical prefill chunk size (cuts at its absolute multiples); None: whole prompts."""
    block_size: int = BLOCK_MULTIPLE
    """Tokens per keyed block: a positive multiple of 32 (the storage chunk of the tiers)."""

    def __post_init__(self) -> None:
        if not isinstance(self.salt, str):
            raise UserError(f"salt must be a str (the tenant's salt, '' for none), got {type(self.salt).__name__}")
        for name, example in (("fingerprint", "engine.fingerprint"), ("layout", "'paged'"),
                              ("precision", "'f16'"), ("numerics", "str(engine.numerics)")):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise UserError(f"{name} must be a non-empty str naming what it keys (e.g. {example}), got {value!r}")
        if not _is_int(self.block_size) or self.block_size <= 0 or self.block_size % BLOCK_MULTIPLE:
            raise UserError(f"block_size must be a positive multiple of {BLOCK_MULTIPLE} (the paged engine's "
                            f"block), got {self.block_size!r}: use 32, 64, 128, 256 or 512")
        if self.chunk_size is not None and (not _is_int(self.chunk_size) or self.chunk_size <= 0):
            raise UserError(f"chunk_size must be a positive int (the engine's prefill_chunk_size) or None "
                            f"(whole prompts), got {self.chunk_size!r}")
        object.__setattr__(self, "block_size", int(self.block_size))  # a numpy int digests as an int
        if self.chunk_size is not None:
            object.__setattr__(self, "chunk_size", int(self.chunk_size))

    @cached_property
    def digest(self) -> bytes:
        """The namespace's own digest: the parent of every chain's first block."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        text = json.dumps({"format": _FORMAT, **values}, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(text.encode(), digest_size=_KEY_BYTES, person=_PERSON_NAMESPACE).digest()

    @property
    def id(self) -> str:
        """The namespace's digest in hex (e.g. to file a tier's blocks by namespace)."""
        return self.digest.hex()

    def chain(self, tokens: Sequence[int] | np.ndarray, *, cuts: Iterable[int] = ()) -> BlockChain:
        """The keys of ``tokens``' full blocks and its partial tail, for KV computed by a canonical
        prefill plus ``cuts`` (absolute positions, 0..len; see the module docstring). Pure.
        ``space.chain(range(70)).keys`` → 2 keys, tail of 6 tokens.

        Raises ``UserError`` for tokens that are not non-negative ints, and for cuts outside
        0..len(tokens)."""
        data = int64_bytes(tokens)
        ids = np.frombuffer(data, dtype="<i8")
        inside = self._cuts(cuts, len(ids))
        size, row = self.block_size, 8 * self.block_size
        parent, keys = self.digest, []
        for index in range(len(ids) // size):
            start = index * size
            block_cuts = inside[bisect_left(inside, start):bisect_left(inside, start + size)]
            parent = _digest(_PERSON_BLOCK, parent, data[index * row:(index + 1) * row], block_cuts, start)
            keys.append(parent.hex())
        start = len(keys) * size
        tail_cuts = inside[bisect_left(inside, start):]
        tail = Tail(start=start, tokens=tuple(int(t) for t in ids[start:]), parent=parent.hex(), cuts=tail_cuts,
                    digest=_digest(_PERSON_TAIL, parent, data[start * 8:], tail_cuts, start).hex())
        return BlockChain(namespace=self, keys=tuple(keys), tail=tail)

    def token_keys(self, tokens: Sequence[int] | np.ndarray) -> tuple[str, ...]:
        """One digest per full block over the tokens alone (no cuts), chained from the namespace:
        how a prompt finds blocks it did not compute — a conversation sent whole to another replica
        looks its blocks up by these (``memory/prompt_kv.py``); never equal to a block key::

            space.token_keys(prompt)[i]   # the same for every log whose first (i + 1) blocks hold these tokens
        """
        data = int64_bytes(tokens)
        size, row = self.block_size, 8 * self.block_size
        parent, out = self.digest, []
        for index in range(len(data) // row):
            parent = _digest(_PERSON_TOKENS, parent, data[index * row:(index + 1) * row], (), index * size)
            out.append(parent.hex())
        return tuple(out)

    def key_of(self, parent: str, start: int, tokens: Sequence[int] | np.ndarray, cuts: Iterable[int] = ()) -> str:
        """The key of one full block: ``tokens`` (``block_size`` ids) at log position ``start`` after
        the block keyed ``parent`` (the namespace's ``id`` for the first block), with ``cuts``
        (absolute positions; those ``chain`` ignores are ignored). What a reader checks a fetched
        block against: ``space.key_of(chain.keys[0], 32, tokens[32:64]) == chain.keys[1]``."""
        data = int64_bytes(tokens)
        if len(data) != 8 * self.block_size:
            raise UserError(f"a block holds {self.block_size} tokens, got {len(data) // 8}")
        if not _is_int(start) or start < 0 or start % self.block_size:
            raise UserError(f"start must be a non-negative multiple of {self.block_size}, got {start!r}")
        try:
            parent_digest = bytes.fromhex(parent)
        except (TypeError, ValueError):
            parent_digest = b""
        if len(parent_digest) != _KEY_BYTES:
            raise UserError(f"parent must be a block key or the namespace id (32 hex digits), got {parent!r}")
        end = int(start) + self.block_size
        inside = self._cuts([c for c in cuts if start <= c < end], end)
        return _digest(_PERSON_BLOCK, parent_digest, data, inside, int(start)).hex()

    def _cuts(self, cuts: Iterable[int], length: int) -> tuple[int, ...]:
        """The cuts that change keys: inside the log, not a multiple of the chunk size, sorted."""
        positions = np.frombuffer(int64_bytes(list(cuts), what="cuts", fix=_CUTS_FIX), dtype="<i8")
        if positions.size and int(positions.max()) > length:
            raise UserError(f"cuts must lie in 0..{length} (positions in this token log), got "
                            f"{int(positions.max())}; {_CUTS_FIX}")
        chunk = self.chunk_size
        return tuple(sorted({int(p) for p in positions if 0 < p < length and not (chunk and p % chunk == 0)}))


@dataclass(frozen=True)
class Tail:
    """The tokens after a log's last full block (fewer than ``block_size``; maybe none): kept with
    the session's record, never a block (see the module docstring)."""

    start: int
    """Log position of the tail's first token (the tokens the full blocks hold)."""
    tokens: tuple[int, ...]
    """The tail's token ids."""
    parent: str
    """The key of the last full block (the namespace's id when there is none)."""
    cuts: tuple[int, ...]
    """The cuts inside the tail (absolute positions) that went into ``digest``."""
    digest: str
    """32 hex digits over the parent, the tail's tokens and cuts: what a record stores to check
    that its tail KV belongs to this history and namespace (never equal to a block key)."""


@dataclass(frozen=True)
class BlockChain:
    """A token log's block keys, oldest first, and its partial tail: ``space.chain(tokens)``."""

    namespace: KVNamespace
    """The namespace the keys were derived in."""
    keys: tuple[str, ...]
    """One key per full block (32 hex digits), in log order: ``keys[i]`` covers tokens
    ``i * block_size`` to ``(i + 1) * block_size``."""
    tail: Tail
    """The tokens after the last full block."""

    def tokens_in(self, blocks: int) -> int:
        """Tokens held by the first ``blocks`` blocks: ``chain.tokens_in(leading_run(chain.keys, has))``."""
        if not _is_int(blocks) or not 0 <= blocks <= len(self.keys):
            raise UserError(f"blocks must be an int in 0..{len(self.keys)} (this chain's blocks), got {blocks!r}")
        return blocks * self.namespace.block_size


def leading_run(keys: Sequence[str], available: Callable[[str], bool]) -> int:
    """How many keys from the first on ``available`` accepts (it stops at the first refused: a
    block is only usable after its parent): ``leading_run(chain.keys, disk.has) == 3``."""
    for count, key in enumerate(keys):
        if not available(key):
            return count
    return len(keys)


def _digest(person: bytes, parent: bytes, tokens: bytes, cuts: Sequence[int], start: int) -> bytes:
    """blake2b over the parent's digest, the tokens' byte count and bytes, then the cuts as offsets
    from ``start`` (where the block or tail begins; the parent already fixes that position)."""
    h = hashlib.blake2b(parent, digest_size=_KEY_BYTES, person=person)
    h.update(len(tokens).to_bytes(8, "little"))
    h.update(tokens)
    h.update(int64_bytes([p - start for p in cuts], what="cuts"))
    return h.digest()


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)
