"""The model steps a decode loop asks its driver for: feed tokens, feed and return several rows of
logits, run several steps choosing each token, trim the log back. Plain data; ``token_steps``
yields them, a driver runs them::

    step = FeedRowsStep([5, 6, 7], rows=3)    # reply: float32 logits [3, vocab]
    step = RunStep([5], steps=8, choose=argmax, ends=lambda t: t == eos)   # reply: the chosen ids
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


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
class RunStep:
    """Feed ``ids``, then each token ``choose(logits)`` picks, until ``steps`` tokens are chosen or
    ``ends(token)`` (``KVLog.feed_run``); the reply is the chosen ids, each fed but the last."""

    ids: list[int]
    steps: int
    choose: Callable[[np.ndarray], int]
    ends: Callable[[int], bool]
    greedy: bool = False
    """``choose`` is the argmax (the lowest id among equals): a slot may take the model's own."""
    started: Callable[[], None] | None = None
    """Called as soon as the run's first model step is under way (while it computes, where the slot
    can: ``PagedModel.step_alone``), or before the run waits for anything else (room made on the
    event loop, another thread's hold on the model): what a driver does then overlaps the model's
    work. Idempotent: a run may call it more than once; it is not called when the run fails first."""


@dataclass(frozen=True)
class TrimStep:
    """Keep only the first ``keep`` generated tokens in the KV log (nothing when it holds no more)."""

    keep: int


ModelStep = FeedStep | FeedRowsStep | RunStep | TrimStep
MODEL_STEPS = (FeedStep, FeedRowsStep, RunStep, TrimStep)
