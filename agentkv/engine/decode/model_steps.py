"""The model steps a decode loop asks its driver for: feed tokens, feed and return several rows of
logits, trim the log back. Plain data; ``token_steps`` yields them, a driver runs them::

    step = FeedRowsStep([5, 6, 7], rows=3)    # reply: float32 logits [3, vocab]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FeedStep:
    """Feed ``ids`` through the model in one step (their KV joins the log); the reply is None."""

    ids: list[int]


@dataclass(frozen=True)
class FeedRowsStep:
    """Feed ``ids`` in one step; the reply is float32 logits ``[rows, vocab]`` of the last ``rows`` ids."""

    ids: list[int]
    rows: int


@dataclass(frozen=True)
class TrimStep:
    """Keep only the first ``keep`` generated tokens in the KV log (nothing when it holds no more)."""

    keep: int


ModelStep = FeedStep | FeedRowsStep | TrimStep
MODEL_STEPS = (FeedStep, FeedRowsStep, TrimStep)
