"""KV as arrays, with no OpenVINO: a session's token log (``log.KVLog``), snapshots (``snapshot``)
and their safetensors files (``snapshot_file``), checksums (``digest``), KV cache precisions
(``precision``) and u8 blocks (``u8_blocks``), RoPE re-rotation (``rope``), the RoPE a model's
config.json / GGUF describes (``rope_metadata``: θ, scaling, partial rotary, per-layer θ) and its
measurement on the model's own keys (``rope_probe``),
chunk boundaries (``chunking``), and the content address of each full block of KV (``block_keys``:
``KVNamespace``, ``BlockChain``, ``leading_run``; internal until the KV store of issue 46 lands).

The engine's backends and the store both build on this package; it imports neither.
"""
