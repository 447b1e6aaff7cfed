"""KV chunks of the prefix caches: a session's cuts as a cache entry keeps them, and the radix
tree's edge snapshots joined back into one (``KVSnapshot.span`` cuts them, cuts re-based)::

    cuts = captured_cuts(session, len(mark))     # where the passes that computed mark's KV began
    whole = join_chunks([edge_kv.span(0, 16), edge_kv.span(16, 40)])
"""

from __future__ import annotations

from agentkv.kv.snapshot import KVSnapshot
from agentkv.kv.snapshot_cuts import Cuts, prefix_cuts


def captured_cuts(session: object, n: int) -> Cuts:
    """The cuts of the first ``n`` tokens of ``session``'s KV (its ``cuts``); None when unknown,
    or when the session does not say (a test's stand-in without ``cuts``):
    ``captured_cuts(session, len(mark))``."""
    cuts = getattr(session, "cuts", None)
    return None if cuts is None else prefix_cuts(tuple(int(c) for c in cuts), n)


def join_chunks(chunks: list[KVSnapshot]) -> KVSnapshot:
    """Consecutive chunks as one snapshot (the single chunk itself when there is one):
    ``KVSnapshot.join`` — shifted if any chunk is, lossless only if every chunk is, cuts re-based."""
    if len(chunks) == 1:
        return chunks[0]
    return KVSnapshot.join(chunks)
