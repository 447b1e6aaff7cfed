"""The KV session: one sequence's KV over a slot, the backend it works through, and the engine
half every backend shares.

- ``session``: ``SlotSession``, the one ``KVSession`` (align, trim, fork, snapshot, restore, drop);
- ``backend``: ``SlotBackend``, the one object a session holds: slot pool, snapshots, holds,
  restores, room for new KV, prefixes, RoPE and the open sessions;
- ``slot_pool``: slots bound to sessions, LRU offload of idle ones, the host KV store;
- ``slot_engine``: ``SlotEngine``, the ``Engine`` protocol over a backend.
"""
