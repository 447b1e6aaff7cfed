"""KV as arrays, with no OpenVINO: a session's token log (``log.KVLog``), snapshots (``snapshot``)
and their safetensors files (``snapshot_file``), checksums (``digest``), KV cache precisions
(``precision``) and u8 blocks (``u8_blocks``), RoPE measurement and re-rotation (``rope``), and
chunk boundaries (``chunking``).

The engine's backends and the store both build on this package; it imports neither.
"""
