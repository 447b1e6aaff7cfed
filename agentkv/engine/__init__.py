"""The engine: tokens and tensors behind one protocol (never messages or SQL).

A map, top to bottom::

    factory      open_engine(): paged unless the device is an NPU or AGENTKV_ENGINE=stateful
    paged/       the default backend: PagedAttention, block pool, block tables, step batcher
    stateful/    the reference/NPU backend: an InferRequest per slot, KV in its state
    openvino/    what both backends read from OpenVINO: models, compile, numerics, tokenizer
    session/     the KV session (SlotSession) and the engine half both backends share
    prefix/      the prefix cache (radix tree from token prefixes to KV)
    decode/      the per-token loop, sampling, beam search, grammar constraints
    base         the protocols (Engine, KVSession, Tokenizer), GenerationConfig, results
    ../kv/       below the engine: token log, snapshots, RoPE, precisions (numpy only)

Public names: ``from agentkv import PagedEngine, StatefulEngine, open_engine, GenerationConfig``.
"""
