"""The paged backend (the default): OpenVINO's PagedAttention with caller-owned KV blocks, in two sides.

The cache side says which blocks hold which KV, and never touches a tensor: the block pool
(``block_pool``: free list, reference counts, reservations), a session's block table
(``block_table``: rows, copy-on-write, trim), blocks shared by reference (``shared_blocks``) and
the prefix cache over them (``prefix``). The runner side computes: the compiled graphs
(``model``, ``graphs``, ``compiled_pool``, ``block_precision``), their inputs
(``request_inputs``), the step batcher that lets sessions decode together (``batcher``,
``draft_share``, ``draft_payoff``) and the copies of KV in and out of the cache tensors (``block_io``). They meet
in three places only (``tests/test_architecture.py`` holds the line, as vLLM v1 splits ``core/``
from ``worker/``): ``slot`` (a block table fed by the model: the KVSlot a session runs on),
``backend`` (snapshots, forks by reference, room made before a step) and ``engine``
(``PagedEngine``, a sibling of ``StatefulEngine`` under ``openvino.engine.OpenVINOEngine``)."""
