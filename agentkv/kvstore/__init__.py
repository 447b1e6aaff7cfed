"""The KV store's blocks: content-addressed KV blocks in tiers, below the engine and the SQL store.

``BlockStore`` (``block_store``) saves a KV log's full blocks under their chain keys
(``kv/block_keys.py``) into tiers fastest first — ``HostBlocks`` (``block_tiers``: process memory,
bounded bytes), ``DiskBlocks`` (``block_files``: a local directory, bounded bytes), and any other
``BlockTier`` (the S3 tier lives with the snapshot storage, ``memory/block_objects.py``) — writing
the persistent ones behind the caller's back (``write_behind``). No SQL and no OpenVINO here: the
engine keeps idle sessions' KV in it, the SQL store names its blocks in rows::

    from agentkv.kvstore.block_store import BlockStore
    from agentkv.kvstore.block_tiers import HostBlocks
    store = BlockStore([HostBlocks(256 << 20)])
"""
