"""KVLog: a session's token log and the KV a slot holds for it — the one place the KV invariant is kept.

Invariant (DESIGN.md): the slot's KV is exactly the KV of ``tokens`` at positions
``0..len-1``, computed by passes beginning at ``cuts`` (and 0). Every method that changes the KV
changes ``tokens`` and ``cuts`` in the same step, and on failure leaves them empty rather than
out of step.

**Cuts.** KV bits depend on where the passes that computed them began (bf16 compute, dynamic
quantisation; even at f32 a one-token decode step differs from a prefill), so the log records
every pass start: ``cuts`` are the sorted, unique positions ``0 < p < len(tokens)`` at which a
pass began (a prefill chunk, a one-token decode step, a draft verification; 0 is implied), or
None when unknown (KV loaded from a snapshot file written before cuts were recorded: it cannot
be keyed, ``kv/block_keys.py``). Every pass start is kept, canonical chunk starts included.

Decode and beam search work through a KVLog; a ``KVSession`` adds locking, leases and
alignment on top. The KV lives in a slot (anything with ``KVSlot``'s methods: a stateful
model's InferRequest, ``engine/slot.py``, or a paged block table, ``engine/paged_slot.py``);
every method blocks and the caller holds the slot's lease::

    log = KVLog(boundaries=engine.boundaries)
    logits = log.feed(slot, prompt_ids)          # canonical chunks; logits after the last id
    rows = log.feed_rows(slot, [t, *draft], 4)   # [4, vocab]: logits after each of the last 4 ids (paged)
    chosen = log.feed_run(slot, [t], steps=8, choose=pick, ends=lambda t: t == eos)   # a greedy run
    log.trim(slot, 10)
    log.check_integrity(slot)
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from agentkv.errors import KVLogCorrupt
from agentkv.kv.chunking import PrefixBoundaries, chunk_spans
from agentkv.kv.rope import RopeConvention, drop_span


class KVSlot(Protocol):
    """What a KVLog needs of a slot (the stateful engine's ``StatefulSlot``, the paged engine's ``PagedSlot``)."""

    def feed(self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None,
             position_offset: int = 0) -> np.ndarray: ...
    def length(self) -> int: ...
    def reset(self) -> None: ...
    def trim(self, n: int) -> None: ...
    def read(self) -> tuple[np.ndarray, np.ndarray]: ...
    def write(self, keys: np.ndarray, values: np.ndarray) -> None: ...
    def select_row(self, row: int, n: int) -> None: ...


class RowsSlot(KVSlot, Protocol):
    """A slot that can return the logits of several last positions (``PagedSlot``; not the
    stateful one, whose compiled model keeps the last position only)."""

    def feed_rows(self, input_ids: np.ndarray, past_len: int, rows: int) -> np.ndarray: ...


def feeds_rows(slot: object) -> bool:
    """True when ``slot`` returns the logits of several positions (``KVLog.feed_rows`` works on it)."""
    return callable(getattr(slot, "feed_rows", None))


class KVSource(Protocol):
    """KV a log can be loaded from: a ``KVSnapshot`` (host copy) or ``SharedBlocks`` (paged blocks
    held by reference: a prefix-cache hit or a fork)."""

    @property
    def tokens(self) -> tuple[int, ...]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def shifted(self) -> bool: ...
    @property
    def lossless(self) -> bool: ...
    @property
    def cuts(self) -> tuple[int, ...] | None: ...
    def write_into(self, slot: KVSlot) -> None: ...
    def release(self) -> None: ...


class KVLog:
    """Token log + last logits + shifted / exact flags of one session's KV."""

    def __init__(self, *, boundaries: PrefixBoundaries | None = None, chunk_size: int | None = None) -> None:
        self.tokens: list[int] = []
        """The tokens whose KV the slot holds, in order."""
        self.cuts: list[int] | None = []
        """Where the passes that computed the KV began: sorted, unique, inside ``(0, len(tokens))``;
        None: unknown (loaded from a snapshot written before cuts were recorded)."""
        self.last_logits: np.ndarray | None = None
        """float32 ``[vocab]`` logits after ``tokens[-1]``, when known."""
        self.shifted = False
        """A span was dropped by a RoPE shift: close to, not equal to, a fresh prefill."""
        self.exact = True
        """False once part of the KV came back from a lossy restore."""
        self._boundaries = boundaries
        self._chunk_size = chunk_size

    def __len__(self) -> int:
        return len(self.tokens)

    def copy(self) -> KVLog:
        """A log of the same tokens, cuts and flags, chunking as this one (a fork's, whose KV is
        held elsewhere until it gets a slot): ``forked = log.copy()``; last logits unknown."""
        copied = KVLog(boundaries=self._boundaries, chunk_size=self._chunk_size)
        copied.tokens, copied.shifted, copied.exact = list(self.tokens), self.shifted, self.exact
        copied.cuts = None if self.cuts is None else list(self.cuts)
        return copied

    def forget(self) -> None:
        """Empty the log without touching a slot (its KV lives elsewhere or nowhere)."""
        self.tokens, self.last_logits, self.shifted, self.exact = [], None, False, True
        self.cuts = []

    def _pass_began(self, position: int) -> None:
        """Record a pass that began at ``position`` (= ``len(tokens)`` before its tokens join)."""
        if self.cuts is not None and position > 0 and (not self.cuts or self.cuts[-1] < position):
            self.cuts.append(position)

    # ---- changes (blocking; the caller holds the slot's lease) -----------------------
    def feed(self, slot: KVSlot, ids: Sequence[int]) -> np.ndarray:
        """Run ``ids`` after the tokens; they join the log. Cut at the canonical chunk
        boundaries (``engine/chunking.py``) so one log is always computed the same way."""
        start = len(self.tokens)
        spans = self._spans(ids)
        logits = self.last_logits
        for begin, end in spans:
            piece = [int(t) for t in ids[begin - start : end - start]]
            logits = slot.feed(np.array([piece], dtype=np.int64), past_len=begin)[0]
            if piece:
                self._pass_began(begin)
            self.tokens.extend(piece)
            self.last_logits = logits
        assert logits is not None
        return logits

    def _spans(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        """The canonical chunks ``[begin, end)`` that feeding ``ids`` after the tokens cuts them in."""
        start = len(self.tokens)
        if len(ids) <= 1:
            return [(start, start + len(ids))]
        cuts = [] if self._boundaries is None else self._boundaries.cuts_within(
            [*self.tokens, *ids], start=start, stop=start + len(ids))
        return chunk_spans(start, start + len(ids), cuts=cuts, chunk_size=self._chunk_size)

    def feed_rows(self, slot: RowsSlot, ids: Sequence[int], rows: int) -> np.ndarray:
        """``feed`` (the same canonical chunks) returning float32 logits ``[rows, vocab]`` of the last
        ``rows`` ids (1..len(ids)): the last row follows ``ids[-1]``. How a draft is verified in one
        step; ``trim`` takes back what the model refused."""
        start, stop = len(self.tokens), len(self.tokens) + len(ids)
        got = []
        for begin, end in self._spans(ids):
            piece = np.array([[int(t) for t in ids[begin - start : end - start]]], dtype=np.int64)
            wanted = min(end - begin, rows - (stop - end))
            logits = slot.feed_rows(piece, begin, wanted) if wanted > 0 else slot.feed(piece, past_len=begin)
            if piece.shape[1]:
                self._pass_began(begin)
            self.tokens.extend(int(t) for t in piece[0])
            self.last_logits = logits[-1]
            if wanted > 0:
                got.append(logits)
        return np.concatenate(got)

    def feed_run(self, slot: KVSlot, ids: Sequence[int], *, steps: int, choose: Callable[[np.ndarray], int],
                 ends: Callable[[int], bool], greedy: bool = False, started: Callable[[], None] | None = None
                 ) -> list[int]:
        """Feed ``ids``, then each token ``choose(logits)`` picks from the last logits, until
        ``steps`` tokens are chosen or ``ends(token)``: the chosen tokens, each fed but the last
        (``last_logits`` are the ones it was chosen from). The feeds are ``feed``'s; a slot with
        ``feed_run`` (paged) runs the one-token steps itself, back to back while its session steps
        alone (``greedy``: ``choose`` is the argmax, which such a slot may take from the model).
        ``started()`` (``RunStep.started``) is called while such a slot's first step computes, else
        before the first feed. Each token the slot's run feeds is a pass of its own (a cut). On
        failure the log holds the tokens fed so far (their cuts too), last logits unknown::

            chosen = log.feed_run(slot, [t], steps=8, choose=pick, ends=lambda t: t in stop_ids)
        """
        chosen: list[int] = []
        run = getattr(slot, "feed_run", None)
        if started is not None and (not callable(run) or len(ids) != 1):
            started()
            started = None
        if not callable(run):  # one feed per token
            logits = self.feed(slot, ids)
            while True:
                chosen.append(choose(logits))
                if len(chosen) >= steps or ends(chosen[-1]):
                    return chosen
                logits = self.feed(slot, chosen[-1:])
        if len(ids) != 1:  # NOTE: several ids go in their canonical chunks; the slot's run takes one token
            chosen.append(choose(self.feed(slot, ids)))
            if len(chosen) >= steps or ends(chosen[-1]):
                return chosen
        token, start, before = int(chosen[-1] if chosen else ids[0]), len(self.tokens), len(chosen)
        try:
            logits = run(token, start, steps=steps - before, choose=choose, ends=ends, chosen=chosen, greedy=greedy,
                         started=started)
        except BaseException:
            fed = [token, *chosen[before:]][: slot.length() - start]
            if fed:
                self._extend_by_steps(fed)
                self.last_logits = None
            raise
        self._extend_by_steps([token, *chosen[before:-1]])
        self.last_logits = logits
        return chosen

    def _extend_by_steps(self, fed: Sequence[int]) -> None:
        """``fed`` joined the log one token per pass (one-token decode steps): each is a cut."""
        for token in fed:
            self._pass_began(len(self.tokens))
            self.tokens.append(int(token))

    def trim(self, slot: KVSlot, n: int) -> None:
        """Keep the first ``n`` tokens and their KV (a trim to 0 makes the log exact again). On
        failure the slot and the log are empty, as after a failed ``load`` (a stateful trim
        rewrites the KV layer by layer: never partial KV)."""
        if n >= len(self.tokens):
            return
        if n == 0:
            slot.reset()
            self.forget()
            return
        try:
            slot.trim(n)
        except BaseException:
            self.clear(slot)
            raise
        del self.tokens[n:]
        self._drop_cuts_from(n)
        self.last_logits = None

    def _drop_cuts_from(self, n: int) -> None:
        """Forget the cuts at positions ``>= n`` (their tokens left the log)."""
        if self.cuts is not None:
            del self.cuts[bisect_left(self.cuts, n):]

    def load(self, slot: KVSlot, source: KVSource, *, exact: bool) -> None:
        """Replace KV and log by ``source``'s — a ``KVSnapshot`` (copied in) or ``SharedBlocks``
        (its blocks pointed at) — (``exact``: the KV is the very values it was read as); the cuts
        are the source's (None: unknown). On failure the slot and the log are empty: never partial KV."""
        try:
            source.write_into(slot)
        except BaseException:
            self.clear(slot)
            raise
        self.tokens, self.last_logits = list(source.tokens), None
        self.cuts = None if source.cuts is None else [int(c) for c in source.cuts if c > 0]  # 0 is implied
        self.shifted, self.exact = source.shifted, exact

    def clear(self, slot: KVSlot) -> None:
        """Empty the slot and the log."""
        slot.reset()
        self.forget()

    def drop(self, slot: KVSlot, start: int, end: int, convention: RopeConvention) -> None:
        """Remove ``tokens[start:end]`` and their KV; later keys re-rotated by −(end−start).
        Marks the log shifted; cuts inside the span go, later ones move down by end−start and
        ``start`` becomes a cut (the KV after it was rewritten). On a failed write the slot and
        the log are empty."""
        keys, values = drop_span(*slot.read(), start, end, convention)
        try:
            slot.write(keys, values)
        except BaseException:
            self.clear(slot)
            raise
        del self.tokens[start:end]
        if self.cuts is not None and end > start:
            later = [c - (end - start) for c in self.cuts if c >= end]
            kept = [c for c in self.cuts if c < start]
            self.cuts = [c for c in sorted({*kept, start, *later}) if 0 < c < len(self.tokens)]
        self.last_logits = None
        self.shifted = True

    def collapse(self, slot: KVSlot, row: int, tokens: Sequence[int], logits: np.ndarray | None = None) -> None:
        """Keep only batch row ``row``, holding ``tokens`` (its first ``len(tokens)`` positions),
        with ``logits`` after them when known (beam search's end). The row's tokens past the log's
        were fed by the beam steps, one token per pass: each is a cut."""
        slot.select_row(row, len(tokens))
        kept = min(len(self.tokens), len(tokens))
        self.tokens = [int(t) for t in tokens[:kept]]
        self._drop_cuts_from(kept)
        self._extend_by_steps(tokens[kept:])
        self.last_logits = logits

    def collapse_feeding(self, slot: KVSlot, row: int, row_tokens: Sequence[int], rest: Sequence[int]) -> np.ndarray:
        """Collapse onto live batch row ``row`` — which holds the log's tokens, then
        ``row_tokens`` (fed by the beam steps, one token per pass) — on the same infer that feeds
        it ``rest`` (one pass: a cut at its start)."""
        past_len = len(self.tokens) + len(row_tokens)
        ids, beam_idx = np.array([list(rest)], dtype=np.int64), np.array([row], dtype=np.int32)
        logits: np.ndarray = slot.feed(ids, past_len, beam_idx)[0]
        self._extend_by_steps(row_tokens)
        if len(rest):
            self._pass_began(len(self.tokens))
        self.tokens.extend(int(t) for t in rest)
        self.last_logits = logits
        return logits

    # ---- reads --------------------------------------------------------------------
    def read(self, slot: KVSlot) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[layers, 1, heads, len(tokens), dim]`` (copies)."""
        return slot.read()

    def check_integrity(self, slot: KVSlot) -> None:
        """Raise ``KVLogCorrupt`` unless the slot holds exactly ``len(tokens)`` positions."""
        held = slot.length()
        if held != len(self.tokens):
            raise KVLogCorrupt(f"the slot holds {held} positions but the log has {len(self.tokens)} tokens")
