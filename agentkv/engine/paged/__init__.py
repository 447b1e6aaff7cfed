"""The paged backend (the default): OpenVINO's PagedAttention with caller-owned KV blocks —
the model (``model``), a block pool (``block_pool``), a block table per session (``slot``),
blocks shared by prefix (``shared_blocks``, ``prefix``) and the step batcher that lets sessions
decode together (``batcher``); ``engine`` ties them into ``PagedEngine``."""
