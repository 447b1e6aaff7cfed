"""Which blocks a full host tier lets go: a chain's first blocks — the ones other chains share, a
system prompt — are its most recently used (saved and read last first), so an LRU tier evicts a
conversation's own last blocks before the prompt every conversation starts with."""

from __future__ import annotations

import numpy as np

from agentkv.kv.block_keys import KVNamespace
from agentkv.kv.snapshot import KVSnapshot
from agentkv.kvstore.block_store import BlockStore
from agentkv.kvstore.block_tiers import HostBlocks

SPACE = KVNamespace(salt="", fingerprint="fp", layout="slots", precision="f32", numerics="exact", chunk_size=None,
                    block_size=32)
PROMPT = list(range(3000, 3064))  # two full blocks every conversation below starts with


def kv(tokens: list[int]) -> KVSnapshot:
    values = np.broadcast_to(np.array(tokens, dtype=np.float32)[:, None], (len(tokens), 4))
    arr = np.ascontiguousarray(values)[None, None, None]
    return KVSnapshot.from_float(tokens, arr, -arr, precision="f32", fingerprint="fp", cuts=())


def held(host: HostBlocks) -> set[str]:
    return {block.key for block in host.listing()}


def block_bytes() -> int:
    probe = BlockStore([HostBlocks(1 << 20)])
    tokens = PROMPT + list(range(32))
    probe.save(kv(tokens), SPACE.chain(tokens))
    usage = probe.usage().tiers[0]
    return usage.nbytes // usage.blocks + 64  # blocks differ by a few header bytes


def test_a_full_host_tier_evicts_a_conversations_own_blocks_before_the_prompt_others_share() -> None:
    host = HostBlocks(3 * block_bytes())
    store = BlockStore([host])
    first, second = PROMPT + list(range(32)), PROMPT + list(range(100, 132))
    one, two = SPACE.chain(first), SPACE.chain(second)
    store.save(kv(first), one)
    assert store.save(kv(second), two).new_blocks == 1  # the prompt's two blocks are stored already
    assert held(host) == {two.keys[0], two.keys[1], two.keys[2]}  # the first conversation's own block left
    assert one.keys[:2] == two.keys[:2]


def test_reading_a_chain_keeps_its_first_blocks_the_most_recently_used() -> None:
    host = HostBlocks(3 * block_bytes())
    store = BlockStore([host])
    first = PROMPT + list(range(32))
    chain = SPACE.chain(first)
    store.save(kv(first), chain)
    assert len(store.load(SPACE, chain.keys).spans) == 3  # read in log order
    other = list(range(500, 532))
    store.save(kv(other), SPACE.chain(other))  # one block of another chain: one block must go
    assert held(host) >= {chain.keys[0], chain.keys[1]} and chain.keys[2] not in held(host)
