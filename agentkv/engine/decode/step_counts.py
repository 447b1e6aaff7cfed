"""StepCounts: how many model steps one caller (a paged slot) ran in, with whom, and how long it waited.

A batched engine's per-call metrics (``GenerationMetrics.model_steps``, ``mean_batch``,
``queued_s``) are the difference of a slot's counts before and after the call.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepCounts:
    """A caller's running totals (mutable; ``since`` gives the part after an earlier copy)::

        before = slot.steps.copy(); ...; slot.steps.since(before).mean_batch
    """

    steps: int = 0
    rows: int = 0
    """Sequences of the steps this caller was in, summed (``rows / steps``: mean batch)."""
    queued_s: float = 0.0

    def add(self, batch_size: int, queued_s: float) -> None:
        self.steps += 1
        self.rows += batch_size
        self.queued_s += queued_s

    def copy(self) -> StepCounts:
        return StepCounts(self.steps, self.rows, self.queued_s)

    def since(self, earlier: StepCounts) -> StepCounts:
        return StepCounts(self.steps - earlier.steps, self.rows - earlier.rows, self.queued_s - earlier.queued_s)

    @property
    def mean_batch(self) -> float:
        return self.rows / self.steps if self.steps else 0.0
