"""The engine: tokens and tensors behind one protocol (never messages or SQL).

A map, top to bottom::

    factory      open_engine(): paged unless the device is an NPU or AGENTKV_ENGINE=stateful
    paged/       the default backend: PagedAttention, block pool, block tables, step batcher
    stateful/    the reference/NPU backend: an InferRequest per slot, KV in its state
    openvino/    the parent both backends share (OpenVINOEngine) and what they read from OpenVINO
    session/     the KV session (SlotSession), the backend it holds (SlotBackend), SlotEngine
    prefix/      the prefix cache (radix tree from token prefixes to KV)
    decode/      the prompt's alignment, the token loop (one worker thread a call), sampling, beams, grammars
    base         the protocols (Engine, KVSession, Tokenizer), GenerationConfig, results
    ../kv/       below the engine: token log, snapshots, RoPE, precisions (numpy only)

Public names: ``from agentkv import PagedEngine, StatefulEngine, open_engine, GenerationConfig``.
"""
