"""The KV session: one sequence's KV over a slot, and what every engine over slots shares.

- ``session``: ``SlotSession``, the one ``KVSession`` (align, trim, fork, snapshot, restore, drop);
- ``common``: what a session keeps whether or not it holds a slot;
- ``slot_pool``: slots bound to sessions, LRU offload of idle ones, the host KV store;
- ``slot_engine``: ``SlotEngine``, the engine half both backends share (pool, prefixes, metrics).
"""
