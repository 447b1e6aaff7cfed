"""Block keys (issue 46, step 1): a chain digest per full block that every process and host derives
alike, that depends on every earlier token and every namespace field, with the partial tail kept
apart and bad input refused with a message saying what to do."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.errors import UserError
from agentkv.kv.block_keys import KVNamespace, leading_run
from agentkv.kv.chunking import chunk_spans

SPACE = KVNamespace(salt="tenant-a", fingerprint="qwen:0123456789abcdef:kv=f16:CPU", layout="paged",
                    precision="f16", numerics="kv=f16 compute=f32 dynamic_quantization=off", chunk_size=256)
TOKENS = list(range(1000, 1100))  # 3 full 32-token blocks and a 4-token tail


def test_same_tokens_and_namespace_give_the_same_keys_and_a_copy_of_the_namespace_too():
    chain = SPACE.chain(TOKENS)
    assert len(chain.keys) == 3 and len(set(chain.keys)) == 3
    assert SPACE.chain(tuple(TOKENS)) == chain
    assert SPACE.chain(np.asarray(TOKENS, dtype=np.int32)).keys == chain.keys
    assert dataclasses.replace(SPACE).chain(TOKENS).keys == chain.keys


def test_keys_are_32_lowercase_hex_digits_usable_as_file_names_and_object_keys():
    chain = SPACE.chain(TOKENS)
    for key in (*chain.keys, chain.tail.digest, SPACE.id):
        assert re.fullmatch(r"[0-9a-f]{32}", key)


def test_a_fresh_process_with_another_hash_seed_derives_the_same_keys():
    seed = "1" if os.environ.get("PYTHONHASHSEED") != "1" else "2"
    code = (
        "import json; from agentkv.kv.block_keys import KVNamespace\n"
        f"space = KVNamespace(**json.loads({json.dumps(json.dumps(dataclasses.asdict(SPACE)))}))\n"
        f"chain = space.chain({TOKENS!r}, cuts=[40, 41])\n"
        "print(json.dumps([hash('agentkv'), chain.keys, chain.tail.digest]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONHASHSEED": seed}).stdout
    their_hash, keys, tail = json.loads(out)
    assert their_hash != hash("agentkv")  # the two processes really hash strings differently
    chain = SPACE.chain(TOKENS, cuts=[40, 41])
    assert (tuple(keys), tail) == (chain.keys, chain.tail.digest)


def test_the_encoding_is_pinned_so_stored_blocks_stay_findable_after_an_upgrade():
    # A change here orphans every block a tier holds: bump _FORMAT on purpose, never by accident.
    space = KVNamespace(salt="", fingerprint="fp", layout="paged", precision="f16", numerics="n", chunk_size=None)
    chain = space.chain(range(70))
    assert chain.keys == ("016f9870cd07d46f6e12e9f3a7c027d0", "773ac9343bf01f6ef9dbb2766882ee0f")
    assert chain.tail.digest == "eaa81f0059ad800d264006ed3bdf62ae"
    # the first key, from the documented encoding alone
    fields = {"block_size": 32, "chunk_size": None, "fingerprint": "fp", "format": "agentkv.block_keys/1",
              "layout": "paged", "numerics": "n", "precision": "f16", "salt": ""}
    root = hashlib.blake2b(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode(),
                           digest_size=16, person=b"agentkv.kv-ns").digest()
    block = hashlib.blake2b(root, digest_size=16, person=b"agentkv.kv-block")
    block.update((32 * 8).to_bytes(8, "little"))
    block.update(b"".join(t.to_bytes(8, "little") for t in range(32)))
    assert block.hexdigest() == chain.keys[0]


@settings(max_examples=60, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31), min_size=1, max_size=300).map(lambda t: t * (1 + 96 // len(t))),
       data=st.data())
def test_changing_token_i_changes_every_key_from_block_i_on_and_none_before(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    changed = [*tokens]
    changed[i] += 1
    before, after = SPACE.chain(tokens), SPACE.chain(changed)
    first = i // SPACE.block_size
    assert before.keys[:first] == after.keys[:first]
    assert all(a != b for a, b in zip(before.keys[first:], after.keys[first:]))
    assert before.tail.digest != after.tail.digest


def test_a_key_depends_on_every_earlier_block_not_only_its_own_tokens():
    changed = SPACE.chain([TOKENS[0] + 1, *TOKENS[1:]])
    assert all(a != b for a, b in zip(SPACE.chain(TOKENS).keys, changed.keys))


@settings(max_examples=40, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31), max_size=200), extra=st.lists(st.integers(0, 2**31), max_size=80))
def test_a_longer_log_keeps_the_keys_of_its_prefix(tokens, extra):
    short, long = SPACE.chain(tokens), SPACE.chain(tokens + extra)
    assert long.keys[: len(short.keys)] == short.keys


@pytest.mark.parametrize(("field", "other"), [
    ("salt", "tenant-b"), ("salt", ""), ("fingerprint", "qwen:fedcba9876543210:kv=f16:CPU"), ("layout", "stateful"),
    ("precision", "u8"), ("numerics", "kv=f16 compute=bf16 dynamic_quantization=32"), ("chunk_size", 512),
    ("chunk_size", None), ("block_size", 64),
])
def test_every_namespace_field_changes_every_key(field, other):
    ours, theirs = SPACE.chain(TOKENS), dataclasses.replace(SPACE, **{field: other}).chain(TOKENS)
    assert ours.keys and theirs.keys and set(ours.keys).isdisjoint(theirs.keys)
    assert ours.tail.digest != theirs.tail.digest


@settings(max_examples=60, deadline=None)
@given(cut=st.integers(1, len(TOKENS) - 1))
def test_a_cut_changes_the_keys_from_the_block_holding_it_on_and_none_before(cut):
    canonical, cut_chain = SPACE.chain(TOKENS), SPACE.chain(TOKENS, cuts=[cut])
    first = cut // SPACE.block_size
    assert canonical.keys[:first] == cut_chain.keys[:first]
    assert all(a != b for a, b in zip(canonical.keys[first:], cut_chain.keys[first:]))
    assert canonical.tail.digest != cut_chain.tail.digest


def test_cuts_the_canonical_prefill_makes_anyway_change_nothing():
    tokens = list(range(600))
    spans = chunk_spans(0, len(tokens), chunk_size=SPACE.chunk_size)  # [(0, 256), (256, 512), (512, 600)]
    every_edge = [edge for span in spans for edge in span]
    assert SPACE.chain(tokens, cuts=every_edge) == SPACE.chain(tokens)
    assert SPACE.chain(tokens, cuts=[300, 300, 20]) == SPACE.chain(tokens, cuts=(20, 300))
    assert SPACE.chain(tokens, cuts=[300]) != SPACE.chain(tokens)


def test_a_decoded_turn_keys_its_blocks_apart_from_a_prefill_of_the_same_tokens():
    prompt, answer = list(range(40)), list(range(900, 940))
    decoded = SPACE.chain(prompt + answer, cuts=range(40, 80))  # each generated token is a pass of its own
    prefilled = SPACE.chain(prompt + answer)
    assert decoded.keys[0] == prefilled.keys[0]  # tokens 0..31: the prompt's pass alone
    assert decoded.keys[1] != prefilled.keys[1]


def test_the_partial_tail_is_kept_apart_with_a_digest_that_is_never_a_block_key():
    chain = SPACE.chain(TOKENS, cuts=[97])
    assert (chain.tail.start, chain.tail.tokens, chain.tail.parent) == (96, tuple(TOKENS[96:]), chain.keys[-1])
    assert chain.tail.cuts == (97,)
    assert chain.tail.digest not in chain.keys
    # the same 96 tokens then more: a full block takes the tail's place and the tail digest is gone
    longer = SPACE.chain(TOKENS + list(range(28)))
    assert longer.keys[:3] == chain.keys[:3] and chain.tail.digest not in longer.keys
    whole = SPACE.chain(TOKENS[:96])
    assert (whole.tail.tokens, whole.tail.start, whole.tail.parent) == ((), 96, whole.keys[-1])
    empty = SPACE.chain([])
    assert (empty.keys, empty.tail.parent) == ((), SPACE.id)


def test_leading_run_counts_the_available_keys_up_to_the_first_missing_one():
    chain = SPACE.chain(TOKENS)
    held = {chain.keys[0], chain.keys[2]}
    assert leading_run(chain.keys, held.__contains__) == 1
    assert leading_run(chain.keys, lambda key: True) == 3
    assert leading_run((), held.__contains__) == 0
    assert chain.tokens_in(leading_run(chain.keys, lambda key: True)) == 96
    with pytest.raises(UserError, match="blocks must be an int in 0..3"):
        chain.tokens_in(4)


@pytest.mark.parametrize(("tokens", "message"), [
    ([1, -2, 3], "token ids must be non-negative, got -2 at index 1"),
    ([1.0, 2.0], "got floats; pass the tokenizer's ids"),
    ([True, False], "got bools"),
    (["1", "2"], "got strings"),
    ([1, None], "got mixed objects"),
    ([2**64], "non-negative ints"),
    ([[1, 2]], "got an array of shape"),
])
def test_bad_tokens_are_refused_with_what_to_pass(tokens, message):
    with pytest.raises(UserError, match=re.escape(message)):
        SPACE.chain(tokens)


@pytest.mark.parametrize(("cuts", "message"), [
    ([101], "cuts must lie in 0..100"),
    ([-1], "cuts must be non-negative"),
    ([2.5], "cuts must be a flat sequence of non-negative ints, got floats; pass the positions"),
])
def test_bad_cuts_are_refused_with_what_to_pass(cuts, message):
    with pytest.raises(UserError, match=re.escape(message)):
        SPACE.chain(TOKENS, cuts=cuts)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("block_size", 48, "block_size must be a positive multiple of 32"),
    ("block_size", 0, "use 32, 64, 128, 256 or 512"),
    ("block_size", -32, "block_size must be a positive multiple of 32"),
    ("block_size", True, "block_size must be a positive multiple of 32"),
    ("block_size", 32.0, "block_size must be a positive multiple of 32"),
    ("fingerprint", "", "fingerprint must be a non-empty str naming what it keys (e.g. engine.fingerprint)"),
    ("fingerprint", "  ", "fingerprint must be a non-empty str"),
    ("layout", "", "layout must be a non-empty str"),
    ("precision", None, "precision must be a non-empty str"),
    ("numerics", "", "numerics must be a non-empty str naming what it keys (e.g. str(engine.numerics))"),
    ("salt", None, "salt must be a str"),
    ("chunk_size", 0, "chunk_size must be a positive int (the engine's prefill_chunk_size) or None"),
])
def test_a_bad_namespace_is_refused_with_what_to_use(field, value, message):
    with pytest.raises(UserError, match=re.escape(message)):
        dataclasses.replace(SPACE, **{field: value})


def test_numpy_sizes_key_like_python_ints():
    numpy_sized = dataclasses.replace(SPACE, block_size=np.int64(64), chunk_size=np.int32(256))
    assert numpy_sized.chain(TOKENS).keys == dataclasses.replace(SPACE, block_size=64).chain(TOKENS).keys
