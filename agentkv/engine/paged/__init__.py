"""The paged backend (the default): OpenVINO's PagedAttention with caller-owned KV blocks —
the model (``model``), a block pool (``block_pool``), a block table per session (``slot``),
blocks shared by prefix (``shared_blocks``, ``prefix``), the step batcher that lets sessions
decode together (``batcher``) and the backend its sessions work through (``backend``: raw
snapshots, forks by reference, room made before a step); ``engine`` ties them into
``PagedEngine``, a sibling of ``StatefulEngine`` under ``openvino.engine.OpenVINOEngine``."""
