"""Cuts of a KV snapshot: check them, and re-base them when a snapshot is cut into spans and joined.

A snapshot's ``cuts`` are the positions, counted from its own first token, at which a pass that
computed its KV began (``kv/log.py``). A snapshot of a whole log starts at absolute position 0,
where a pass always begins, so it never stores 0. A span cut out of the middle of a log stores
0 when a pass began at its first token: that is what ``join`` needs to give the whole back::

    span_cuts((5, 9, 12), 9, 16)            # (0, 3): a pass began at the span's first token
    span_cuts((5, 9, 12), 6, 16)            # (3, 6): none began at its first token
    join_cuts([((5,), 9), ((0, 3), 7)])     # (5, 9, 12)

None means unknown (a snapshot file written before cuts were recorded): a span or join of it is
unknown too.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from agentkv.errors import UserError

Cuts = tuple[int, ...] | None
"""Sorted, unique positions in ``[0, num_tokens)``; None: unknown."""


def checked_cuts(cuts: Sequence[int] | None, num_tokens: int) -> Cuts:
    """``cuts`` as a tuple of ints, or ``UserError`` unless sorted, unique and inside
    ``[0, num_tokens)``: ``checked_cuts([3, 5], 8) == (3, 5)``."""
    if cuts is None:
        return None
    if isinstance(cuts, (str, bytes)) or not all(_is_int(c) for c in cuts):
        raise UserError(f"cuts must be a sequence of int positions (where passes began), got {cuts!r}")
    values = tuple(int(c) for c in cuts)
    if any(b <= a for a, b in zip(values, values[1:])):
        raise UserError(f"cuts must be sorted and unique, got {list(values)}; pass sorted(set(cuts))")
    if values and (values[0] < 0 or values[-1] >= num_tokens):
        raise UserError(f"cuts must lie in 0..{num_tokens - 1} (the snapshot's {num_tokens} tokens), "
                        f"got {list(values)}; a cut at num_tokens or beyond cuts nothing: leave it out")
    return values


def prefix_cuts(cuts: Cuts, n: int) -> Cuts:
    """The cuts of the first ``n`` tokens: ``prefix_cuts((3, 9), 5) == (3,)``."""
    return None if cuts is None else cuts[: bisect_left(cuts, n)]


def span_cuts(cuts: Cuts, start: int, stop: int) -> Cuts:
    """The cuts of tokens ``start:stop`` counted from ``start``; 0 kept when a pass began at
    ``start``: ``span_cuts((5, 9), 5, 12) == (0, 4)``."""
    if cuts is None:
        return None
    return tuple(c - start for c in cuts[bisect_left(cuts, start): bisect_left(cuts, stop)])


def join_cuts(parts: Sequence[tuple[Cuts, int]]) -> Cuts:
    """The cuts of consecutive spans ``(cuts, num_tokens)`` as one: each later span's start is a
    cut when its cuts hold 0; unknown if any part's are: ``join_cuts([((), 4), ((0,), 4)]) == (4,)``."""
    joined: list[int] = []
    offset = 0
    for cuts, num_tokens in parts:
        if cuts is None:
            return None
        joined.extend(c + offset for c in cuts)
        offset += num_tokens
    return tuple(joined)


def _is_int(value: object) -> bool:
    return hasattr(value, "__index__") and not isinstance(value, bool)
