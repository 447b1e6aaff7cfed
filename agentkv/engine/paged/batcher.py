"""StepBatcher: sequences fed at the same time from different sessions run as one paged-model step.

Continuous batching by group commit. Each session feeds its own tokens from its own worker
thread (``PagedSlot.feed``) and blocks; whichever caller finds the model idle becomes the
leader, takes the waiting sequences in arrival order — up to ``max_batch`` sequences and
``max_tokens`` tokens, always at least one — runs them in one step and hands every caller its
logits. Sequences that arrive while a step runs wait for the next one. A leader gives the
callers that stepped in either of the last two steps and are not queued yet a moment to come
back (they are sampling their next token): ``gather`` × the last step's duration, at most
``max_gather_s``. Decoding sessions so stay in one step instead of splitting into groups that
take turns (measured before: four sessions settled into two alternating pairs, mean batch 2.0)::

    batcher = StepBatcher(model.step, max_batch=16)
    out = batcher.run(SequenceStep(ids=[42], past_len=130, blocks=table), caller=slot)
    out.logits, out.batch_size, out.queued_s      # [vocab]; this step's sequences; time waited
    batcher.stats()            # steps, sequences, tokens, largest batch, time queued
    batcher.recent_steps()     # the last steps one by one: sequences, tokens, seconds, tokens/s
    batcher.load(caller=slot)  # others stepping now; how many drafted tokens this caller may feed
    batcher.forget(slot)       # its call ended: nobody waits for it
    alone = batcher.alone(slot)  # the model to itself while nobody else steps (None: others do)

A caller that steps alone may take the model for several steps in a row (``alone``: a greedy
run, ``PagedSlot.feed_run``) without going through the queue each time; it hands the model back
after the step during which another caller queued, so nobody waits longer than one step.

Drafts (sequences asking for several positions' logits) share steps with the others within a
budget (``draft_share.py``: ≤ 5 % slower for plain sessions; sessions that all draft verify
together); ``draft_cap`` tells a caller with a draft its share, ``load`` reports it.
A failed step raises its error in every caller of that step. No sessions here.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import islice

import numpy as np

from agentkv.engine.paged.draft_payoff import FIT_STEPS, REFIT_STEPS, DraftPayoff
from agentkv.engine.paged.draft_share import DraftShare
from agentkv.engine.paged.model import SequenceStep, logit_rows
from agentkv.errors import UserError

DEFAULT_MAX_TOKENS = 4096
"""Tokens one step takes at most from the queue (a longer sequence still runs, alone)."""
DEFAULT_GATHER = 0.5
"""A leader waits at most this fraction of the last step's duration for the rest of its batch."""
DEFAULT_MAX_GATHER_S = 0.02
"""…and never longer than this (a decode step of the default model over eight sequences takes
~35 ms on two cores; measured: 4 ms was too short to keep six sessions together, mean batch 3.6)."""
DRAFTER_STEPS = 8
"""Steps a caller that had a draft to feed counts as drafting (not a plain session the budget of
``draft_share.py`` protects): a quoting session has one most steps, and after a missed draft its
lookups pause for 1, 2, 4… chances (``DraftBudget``)."""
RECENT_STEPS = 1024
"""Steps ``recent_steps()`` remembers."""


@dataclass(frozen=True)
class StepOutcome:
    """What one caller got from its step."""

    logits: np.ndarray
    """float32 ``[vocab]`` of the caller's last position."""
    positions: np.ndarray | None
    """float32 ``[last_rows, vocab]`` of its last positions when it asked for more than one, else None."""
    batch_size: int
    """Sequences in the step (1: it ran alone)."""
    queued_s: float
    """Seconds the caller waited before its step began."""


@dataclass(frozen=True)
class StepRecord:
    """One model step."""

    sequences: int
    tokens: int
    seconds: float
    queued_s: float
    """Longest wait of a sequence in the step."""
    ended_at: float = 0.0
    """``time.perf_counter()`` when the step ended."""
    drafting: int = 0
    """Sequences in the step that verified a draft (asked for several positions' logits)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class StepStats:
    """Counters of a ``StepBatcher`` since it was made."""

    steps: int
    """Model steps run."""
    sequences: int
    """Sequences fed, summed over steps (``sequences / steps`` is the mean batch)."""
    tokens: int
    """Tokens fed, summed over steps."""
    largest_batch: int
    """Most sequences in one step."""
    queued_s: float
    """Seconds sequences spent waiting for their step, summed."""
    busy_s: float
    """Seconds spent inside steps."""

    @property
    def mean_batch(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0


@dataclass(frozen=True)
class StepLoad:
    """What a caller's next feed would share (``batcher.load(caller)``)."""

    others: int
    """Other callers that stepped in the last two steps (0: the caller steps alone)."""
    draft_cap: int
    """Most drafted tokens the caller's next feed may carry now (``DraftShare.cap``)."""
    draft_credit: float
    """The shared steps' draft budget left, in steps (``DraftShare.credit``)."""


class AloneSteps:
    """The model held by one caller while nobody else steps (``StepBatcher.alone``): it runs its
    steps itself, ``counted`` after each, and ``close()`` hands the model back::

        alone = batcher.alone(slot)
        if alone is not None:
            try:
                while ...:
                    started = time.perf_counter(); logits = model.step_alone(...)
                    alone.counted(started)
                    if alone.others_waiting: break
            finally:
                alone.close()
    """

    __slots__ = ("_batcher", "caller", "_steps", "_closed")

    def __init__(self, batcher: StepBatcher, caller: Hashable) -> None:
        self._batcher, self.caller = batcher, caller
        self._steps: list[tuple[float, float]] = []
        self._closed = False

    @property
    def others_waiting(self) -> bool:
        """Another caller queued for a step: hand the model back after this one."""
        return bool(self._batcher._queue)  # noqa: SLF001 - a length read; the batcher's own helper

    def counted(self, started: float) -> None:
        """A one-token step that began at ``started`` (``time.perf_counter()``) has just ended."""
        self._steps.append((started, time.perf_counter()))

    def close(self) -> None:
        """Count the steps and hand the model back (once: a second call does nothing)."""
        if self._closed:
            return
        self._closed = True
        steps, self._steps = self._steps, []
        self._batcher._end_alone(self.caller, steps)  # noqa: SLF001


class _Pending:
    __slots__ = ("sequence", "caller", "queued_at", "outcome", "error", "done")

    def __init__(self, sequence: SequenceStep, caller: Hashable | None) -> None:
        self.sequence = sequence
        self.caller = caller
        self.queued_at = time.perf_counter()
        self.outcome: StepOutcome | None = None
        self.error: BaseException | None = None
        self.done = False


class StepBatcher:
    """Runs ``step(sequences) -> logits [S, vocab]`` for concurrent callers, batched. Thread-safe."""

    def __init__(
        self,
        step: Callable[[Sequence[SequenceStep]], np.ndarray],
        *,
        max_batch: int = 16,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        gather: float = DEFAULT_GATHER,
        max_gather_s: float = DEFAULT_MAX_GATHER_S,
    ) -> None:
        if max_batch < 1 or max_tokens < 1 or gather < 0 or max_gather_s < 0:
            raise UserError(f"max_batch and max_tokens must be >= 1, gather and max_gather_s >= 0; got "
                            f"{max_batch}, {max_tokens}, {gather}, {max_gather_s}")
        self._step = step
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.gather = gather
        self.max_gather_s = max_gather_s
        self._changed = threading.Condition()
        self._queue: deque[_Pending] = deque()
        self._running = False
        self._last_step_s = 0.0
        self._recent: dict[Hashable, int] = {}  # caller -> the step it was last in
        self._drafters: dict[Hashable, int] = {}  # caller -> the step count when it last had a draft to feed
        self._steps = self._sequences = self._tokens = self._largest = 0
        self._queued_s = self._busy_s = 0.0
        self._records: deque[StepRecord] = deque(maxlen=RECENT_STEPS)
        self._drafts = DraftShare()
        self._payoff = DraftPayoff()

    def run(self, sequence: SequenceStep, caller: Hashable | None = None) -> StepOutcome:
        """Feed ``sequence`` in the next step that has room; its logits and how its step went.
        ``caller`` (e.g. the slot) identifies whose next feed the following steps may wait for
        (None: nobody waits for this caller)."""
        pending = _Pending(sequence, caller)
        with self._changed:
            self._queue.append(pending)
            self._changed.notify_all()
            while not pending.done:
                if self._running:
                    self._changed.wait()
                    continue
                self._running = True
                try:
                    self._gather()
                    batch = self._take()
                    self._changed.release()
                    try:
                        self._execute(batch)
                    finally:
                        self._changed.acquire()
                finally:
                    self._running = False
                    self._changed.notify_all()
        if pending.error is not None:
            raise pending.error
        assert pending.outcome is not None
        return pending.outcome

    def alone(self, caller: Hashable) -> AloneSteps | None:
        """The model for ``caller``'s steps alone when nobody else steps, waits or stepped in the
        last two steps (None otherwise: feed through ``run``, batched). Until ``close()``,
        others queue as during a step: see ``AloneSteps`` for a call."""
        with self._changed:
            if self._running or self._queue or any(c != caller for c in self._recent):
                return None
            self._running = True
        return AloneSteps(self, caller)

    def _end_alone(self, caller: Hashable, steps: list[tuple[float, float]]) -> None:
        """Count ``caller``'s steps taken alone, and let the queue run."""
        with self._changed:
            try:
                for started, ended in steps:
                    self._count([caller], [0.0], started, ended, tokens=1, drafting=0)
            finally:
                self._running = False
                self._changed.notify_all()

    def forget(self, caller: Hashable) -> None:
        """``caller`` ended its call: no step waits for its next feed, and it no longer counts as
        stepping (``batcher.forget(slot)``). Without this, the next two steps of another caller
        would each wait ``gather`` × a step for it (measured: ~12 ms a step here)."""
        with self._changed:
            self._drafters.pop(caller, None)
            if self._recent.pop(caller, None) is not None:
                self._changed.notify_all()

    def stats(self) -> StepStats:
        """The counters now."""
        with self._changed:
            return StepStats(self._steps, self._sequences, self._tokens, self._largest, self._queued_s, self._busy_s)

    def recent_steps(self) -> list[StepRecord]:
        """The last steps (at most ``RECENT_STEPS``), oldest first."""
        with self._changed:
            return list(self._records)

    def load(self, caller: Hashable | None = None) -> StepLoad:
        """How many other callers stepped lately or wait for a step, and the drafted tokens
        ``caller``'s next feed may carry (``batcher.load(slot).draft_cap``). Read-only."""
        with self._changed:
            others, plain = self._others(caller)
            return StepLoad(others, self._drafts.cap(others, plain), self._drafts.credit)

    def draft_cap(self, caller: Hashable) -> int:
        """The drafted tokens ``caller``, which has a draft to feed next, may feed with it
        (``batcher.draft_cap(slot)``); asking marks the caller as drafting for ``DRAFTER_STEPS``
        steps, so the others' drafts do not count it as a plain session to protect."""
        with self._changed:
            self._drafters[caller] = self._steps
            others, plain = self._others(caller)
            if others and not plain and not self._payoff.pays(others + 1):
                return 0  # many sessions drafting at once: plain steps give more tokens per second
            return self._drafts.cap(others, plain)

    def note_draft(self, drafted: int, accepted: int) -> None:
        """A draft ended: ``drafted`` tokens fed, ``accepted`` confirmed (``DraftPayoff.note``)."""
        with self._changed:
            self._payoff.note(drafted, accepted)

    def _others(self, caller: Hashable | None) -> tuple[int, int]:
        """How many other callers stepped lately or wait for a step, and how many of them are plain
        (had no draft to feed in the last ``DRAFTER_STEPS`` steps) (``_changed`` held)."""
        # NOTE: a caller already queued shares the next step even when it did not step lately
        others = (set(self._recent) | {p.caller for p in self._queue if p.caller is not None}) - {caller}
        plain = sum(1 for c in others if c not in self._drafters)
        return len(others), plain

    # ---- the leader's part (``_changed`` held unless said otherwise) -------------------
    def _gather(self) -> None:
        """Wait a moment (see the module docstring) for the recent callers not queued yet (a
        caller ``forget`` drops meanwhile is not waited for)."""
        deadline = time.perf_counter() + min(self.max_gather_s, self.gather * self._last_step_s)
        while len(self._queue) < self.max_batch and not (
                {c for c, step in self._recent.items() if step >= self._steps - 1}
                <= {p.caller for p in self._queue}):
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._changed.wait(left)

    def _take(self) -> list[_Pending]:
        """The first waiting sequences in arrival order within the batch and token caps."""
        batch = [self._queue.popleft()]
        tokens = len(batch[0].sequence.ids)
        while self._queue and len(batch) < self.max_batch:
            more = len(self._queue[0].sequence.ids)
            if tokens + more > self.max_tokens:
                break
            batch.append(self._queue.popleft())
            tokens += more
        return batch

    def _execute(self, batch: list[_Pending]) -> None:
        """Run one step for ``batch`` (without ``_changed``), count it, then hand out the results.
        A caller sees its step done only once the step is counted: a ``forget`` of a caller that
        ended right after it is never undone by this step's bookkeeping."""
        started = time.perf_counter()
        sequences = [p.sequence for p in batch]
        try:
            logits = self._step(sequences)
        except BaseException as error:  # every caller of the step learns why it failed
            for p in batch:
                p.error = error
        else:
            end = 0
            for count, p in zip(logit_rows(sequences), batch):
                end += count
                rows = logits[end - count:end] if p.sequence.last_rows > 1 else None
                p.outcome = StepOutcome(logits[end - 1], rows, len(batch), started - p.queued_at)
        ended = time.perf_counter()
        tokens = sum(len(p.sequence.ids) for p in batch)
        drafting = sum(1 for p in batch if p.sequence.last_rows > 1 and len(p.sequence.ids) > 1)
        with self._changed:
            try:
                self._count([p.caller for p in batch], [started - p.queued_at for p in batch], started, ended,
                            tokens=tokens, drafting=drafting)
            finally:
                for p in batch:
                    p.done = True

    def _count(self, callers: list[Hashable | None], waits: list[float], started: float, ended: float, *,
               tokens: int, drafting: int) -> None:
        """The counters, the recent callers and the draft credit after a step of ``callers``'
        sequences, which waited ``waits`` seconds for it (``_changed`` held)."""
        self._last_step_s = ended - started
        self._steps += 1
        for caller in callers:
            if caller is not None:
                self._recent[caller] = self._steps
        self._recent = {c: step for c, step in self._recent.items() if step >= self._steps - 1}
        self._drafters = {c: step for c, step in self._drafters.items() if step >= self._steps - DRAFTER_STEPS}
        self._drafts.record(len(callers), drafting, shared=len(self._recent) > 1,
                            plain=any(c not in self._drafters for c in self._recent))
        self._sequences += len(callers)
        self._tokens += tokens
        self._largest = max(self._largest, len(callers))
        self._queued_s += sum(waits)
        self._busy_s += ended - started
        self._records.append(StepRecord(len(callers), tokens, ended - started, max(waits), ended, drafting))
        if self._steps <= REFIT_STEPS or self._steps % REFIT_STEPS == 0:  # NOTE: each step while few
            self._payoff.refit([(r.tokens, r.seconds) for r in islice(reversed(self._records), FIT_STEPS)])
