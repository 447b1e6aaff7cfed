"""DraftPayoff: whether sessions that all draft gain tokens per second by verifying their drafts together.

A step of N sequences costs about ``c0 + c1·tokens`` seconds: ``c0`` reading the weights and
running the graph, ``c1`` per token fed. Drafting ``k`` tokens in each of D sequences adds
``D·k·c1`` seconds and ``D·k·a`` tokens, ``a`` the share of drafted tokens the model confirms.
That raises the step's tokens per second exactly when ``a > N·c1 / (c0 + N·c1)`` — the share of a
plain step's time its tokens cost — whatever D and k. Few sequences: the weights dominate and
drafts pay; many: each token fed costs what a confirmed one earns, and plain steps do better.
Measured on the default model (avx2 EPYC, 2 cores): one sequence alone verifying 17 tokens takes
~2.7× a one-token step (``c1/c0`` ≈ 0.12), quoting confirms a ≈ 0.3 of its drafted tokens, so
drafting together pays up to ~4 sequences; 8 and 16 sessions drafting together decoded slower in
aggregate than 4 (``benchmarks/concurrency.py``).

``c0`` and ``c1`` are fitted to the batcher's recent steps (least squares of seconds on tokens,
refitted every ``REFIT_STEPS`` steps: not on each draft's question), ``a`` is a decaying count of
the drafts' outcomes::

    payoff = DraftPayoff()
    payoff.note(drafted=16, accepted=5)                    # each draft's outcome (the slots report it)
    payoff.refit([(1, 0.008), (17, 0.021)])                # recent steps' (tokens, seconds)
    payoff.pays(sequences=4)

Not thread-safe: its owner (``StepBatcher``) calls it under its lock. No model here.
"""

from __future__ import annotations

from collections.abc import Sequence

PRIOR_TOKEN_COST = 0.12
"""``c1 / c0`` before the steps give a fit (one sequence: a 17-token verify ~2.7× a one-token step)."""
DECAY = 0.98
"""Weight each earlier draft outcome keeps per new one (~50 drafts' memory)."""
FIT_STEPS = 256
"""Recent steps the cost fit reads."""
REFIT_STEPS = 32
"""Steps between two fits of the step cost (the batcher refits as it counts a step)."""


class DraftPayoff:
    """Drafts' confirmed share and the step cost, to decide whether drafting together pays.
    See the module docstring for a call."""

    def __init__(self) -> None:
        self.drafted = 0.0
        """Drafted tokens, decayed (``DECAY`` per draft)."""
        self.accepted = 0.0
        """Of them, those the model confirmed, decayed alike."""
        self.token_cost = PRIOR_TOKEN_COST
        """``c1 / c0`` of the last fit (``refit``)."""

    def note(self, drafted: int, accepted: int) -> None:
        """Count one finished draft: ``drafted`` tokens fed, ``accepted`` of them confirmed."""
        if drafted > 0:
            self.drafted = self.drafted * DECAY + drafted
            self.accepted = self.accepted * DECAY + min(accepted, drafted)

    @property
    def acceptance(self) -> float | None:
        """The confirmed share of drafted tokens lately (None before any draft ended)."""
        return self.accepted / self.drafted if self.drafted > 0 else None

    def refit(self, steps: Sequence[tuple[int, float]]) -> None:
        """Fit the step cost to recent ``steps`` as ``(tokens, seconds)`` (its last ``FIT_STEPS``)."""
        self.token_cost = token_cost_ratio(steps[-FIT_STEPS:])

    def pays(self, sequences: int) -> bool:
        """Whether ``sequences`` sequences that all draft gain tokens per second by drafting, at the
        last fit's step cost. True before any draft's outcome is known."""
        acceptance = self.acceptance
        if acceptance is None:
            return True
        share = sequences * self.token_cost / (1 + sequences * self.token_cost)
        return acceptance > share


def token_cost_ratio(steps: Sequence[tuple[int, float]]) -> float:
    """``c1 / c0`` of ``seconds ≈ c0 + c1·tokens`` fitted to ``steps`` (least squares), or
    ``PRIOR_TOKEN_COST`` when they do not spread over token counts or give a fit that is not positive."""
    n = len(steps)
    if n < 8:
        return PRIOR_TOKEN_COST
    mean_t = sum(t for t, _ in steps) / n
    mean_s = sum(s for _, s in steps) / n
    spread = sum((t - mean_t) ** 2 for t, _ in steps)
    if spread < n:  # NOTE: token counts within ~1 of each other: no slope to read
        return PRIOR_TOKEN_COST
    c1 = sum((t - mean_t) * (s - mean_s) for t, s in steps) / spread
    c0 = mean_s - c1 * mean_t
    return c1 / c0 if c1 > 0 and c0 > 0 else PRIOR_TOKEN_COST
