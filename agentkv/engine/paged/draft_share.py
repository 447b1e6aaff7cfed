"""DraftShare: how often a prompt-lookup draft may ride in a step shared with other sessions.

A session verifying a draft feeds 1 + k tokens in the step where the others feed one each; the
others wait for that longer step. Measured on the default model (avx2 EPYC, 2 cores shared with
other work, f16 KV; 8 sequences of 300–1,000 tokens of history, a 64 ms step; the
configurations interleaved step by step, medians of 30 steps): turning one of the 8 one-token
sequences into a verify of 2, 5, 9 or 17 tokens makes the step 1.17, 1.27, 1.42, 1.84× as long
(under heavier load 1.27 … 1.87×, and 1.42 … 2.24×); two such sequences of 17 tokens 2.50×,
four 3.88× (in ``benchmarks/decode.py``'s batched workload, 4 quoting sessions drafting in one
step of 8: 3.1–4.3×). The first extra tokens cost most, later ones less: a drafting sequence
costs the others 0.7–0.9 of a step at 16 drafted tokens (1.2 measured once), so ``DRAFT_COST``
charges one step whatever its size and a draft that rides goes as large as it may. Drafting in
every step they could, 4 of 8 sessions made the others' steps 2.1–2.3× as long.

The others' slowdown is (N + D·(1 + c)) / (N + D) over N plain and D drafting shared steps, so
drafts may spend c·D ≤ 5 % of the shared steps. A credit bucket holds that budget: each shared
step earns ``DRAFT_SHARE``, each drafting sequence in a shared step spends ``DRAFT_COST``; a
session may draft when the credit holds a whole draft, and one that steps alone always may
(nobody waits for it). Sessions that see the credit at once draft in one step (4 of them: a step
3.1–4.3× a plain one, cheaper per draft than one at a time) and leave the credit below zero:
with a share of 4 % such a burst plus the next one came within the ~100 steps of a batched round
(others' steps 1.02–1.06×, median 1.044, over 10 rounds); at 3 % the credit such a burst owes
takes ~130 steps to earn back. Measured at 3 % (batched workload, 4 rounds): 0.9 % of the shared steps
carried drafts, the others' steps took 1.01–1.03× (median 1.02) as long as without them, the
quoting sessions decoded 1.03× faster (1.08–1.15× at 4 %; 1.64× with drafts unbounded, the
others then 2.1–2.3× slower)::

    share = DraftShare()
    share.record(sequences=8, drafting=0, shared=True)     # after each step (the batcher does)
    cap = share.cap(others=7, plain=3)   # MAX_DRAFT when the credit holds a draft (or no plain
                                         # session shares the steps), else 0

The budget protects *plain* sessions — those not drafting lately (free text, where lookups find
nothing). When every other caller sharing the steps drafts too (several sessions quoting at once),
nobody plain waits for a verify: each verifies its drafts in the shared steps, so N sessions
together keep what one alone wins by drafting (issue 47, item 6), and such a step spends no credit.

Not thread-safe: its owner (``StepBatcher``) calls it under its lock. No model here.
"""

from __future__ import annotations

from agentkv.engine.decode.prompt_lookup import MAX_DRAFT

SLOWDOWN_TARGET = 0.05
"""Most the other sessions' tokens/s may drop because drafts share their steps (issue 27)."""
DRAFT_SHARE = 0.03
"""Credit each shared step earns, in steps (under ``SLOWDOWN_TARGET``: room for a burst of drafts)."""
DRAFT_COST = 1.0
"""What one drafting sequence costs the others of its step, in steps (measured 0.7–0.9 for a
16-token draft among 8 sequences, 1.2 once under heavy load; see the module docstring)."""
MOST_DEBT = 4.0
"""Drafts' debt is forgotten beyond this many drafts' cost (a burst of sessions drafting in one
step, or a race with a caller that had not stepped lately, then blocks drafts for at most
``(1 + MOST_DEBT) * cost / share`` shared steps, not for good)."""


class DraftShare:
    """The credit bucket of one batcher's shared steps. See the module docstring for a call."""

    def __init__(self, share: float = DRAFT_SHARE, cost: float = DRAFT_COST) -> None:
        self.share, self.cost = share, cost
        self.credit = cost
        """Steps' worth of slowdown drafts may still spend (a whole draft at most; below 0 after
        several sessions drafted in one step: it earns back before the next)."""
        self.drafted_steps = 0
        """Shared steps that carried a draft."""
        self.shared_steps = 0
        """Steps run while other callers were stepping too."""

    def record(self, sequences: int, drafting: int, shared: bool, plain: bool = True) -> None:
        """Count a step of ``sequences`` sequences, ``drafting`` of them verifying a draft;
        ``shared``: other callers were stepping too (the step's own, or the last steps');
        ``plain``: one of those callers is plain (had no draft lately) — without one, the drafts
        made nobody plain wait, and the step spends no credit."""
        if not shared and sequences < 2:
            return
        self.shared_steps += 1
        self.drafted_steps += drafting > 0
        spent = self.cost * drafting if plain else 0.0
        self.credit = min(self.cost, max(-MOST_DEBT * self.cost, self.credit + self.share - spent))

    def cap(self, others: int, plain: int | None = None) -> int:
        """The most drafted tokens a session may feed next: ``MAX_DRAFT`` alone (``others`` == 0:
        no other caller stepped in the last steps), when none of the others is plain (``plain``:
        how many did not draft lately; None: all of them), or when the credit holds a draft; else 0."""
        plain = others if plain is None else plain
        return MAX_DRAFT if others == 0 or plain == 0 or self.credit >= self.cost - 1e-9 else 0
