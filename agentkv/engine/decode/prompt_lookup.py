"""Prompt-lookup drafts: guess the next tokens from the session's own log, let the model check them in one step.

Agents repeat what they have seen (tool results, files, the user's words). ``PromptLookup`` finds
the latest earlier occurrence of the log's last ``n`` tokens (``n`` from ``MAX_NGRAM`` down to
``MIN_NGRAM``) and proposes the tokens that followed it. ``Drafts`` feeds the pending tokens plus
that draft as one chunk with the logits of every drafted position (a paged slot's ``feed_rows``);
the decode loop then chooses token by token from those rows as usual, and each chosen token that
equals the next drafted one is already fed. The first token that differs ends the draft: the
rest is trimmed from the KV log (an exact trim); a verify step yields accepted + 1 tokens.
Greedy: the chosen token is the argmax (under the grammar's mask), so the output is the one
plain decoding gives. Sampled: the draft is deterministic (q one-hot on the drafted token x), so
the speculative rejection rule is: accept x with probability p(x), p the distribution the sampler
draws from there (``sampling.target_distribution``: penalties, mask, temperature, top-k/p, min-p),
else draw from p without x, renormalised. One uniform does both: the draw by inverse CDF from p
lands on x with probability p(x), and elsewhere on y with probability p(y) = (1 - p(x)) ·
p(y) / (1 - p(x)). So the loop draws from the verify row as plain decoding would and accepts when
the draw equals x: the output distribution is unchanged, a grammar-forbidden x (p = 0) is never
accepted, and a seeded call uses one draw per token either way (the same tokens with drafts on
or off under exact numerics). Pure Python and numpy::

    lookup = PromptLookup(prompt_ids)
    lookup.push(token)                # every generated token
    draft = lookup.propose(5)         # [] when the last tokens occurred nowhere before
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.engine.decode.model_steps import FeedRowsStep, FeedStep, ModelStep, TrimStep

MAX_NGRAM = 3
"""Longest suffix looked up (openvino-genai's prompt lookup uses 3 too)."""
MIN_NGRAM = 2
"""Shortest suffix looked up: a one-token match guesses too often wrong to pay for its rows."""
MAX_DRAFT = 12
"""Tokens a draft proposes while drafts go well (fewer where ``max_new_tokens`` or a shared step's
cap ends it). A lookup that finds fewer is padded to the size (repeating what it found: its match
ran into the log's end), so a session's verifies keep few shapes: a shape change costs the CPU
plugin ~7–12 ms of a ~20 ms step (``PagedModel``; forced runs and shared steps still vary).
Measured on the default model (avx2 CPU, quoting, one run, interleaved): 12 tokens 1.99× plain
decoding, 8 1.92×, 16 1.80×, sizes that adapt to acceptance (8, doubling while accepted whole,
else shrinking to what was accepted + 1) 1.69×; tool calls and greedy free text equal within noise."""
SMALL_DRAFT = 3
"""Tokens a draft proposes after one that confirmed fewer than ``GOOD_DRAFT`` (back to
``MAX_DRAFT`` after one that confirmed that many): a 13-token verify costs ~2.5–3 one-token steps,
a loss when it yields 1–2 tokens. Measured: sampled free text (T 0.7) 0.84× plain decoding with
12-token drafts only."""
GOOD_DRAFT = 2
"""Confirmed tokens (or the whole draft, if shorter) that keep drafts at ``MAX_DRAFT``."""
MAX_BACKOFF = 16
"""After a draft the model refused at once, that many next chances to draft are skipped (doubling
from 1 on each refusal in a row, up to this): free text then pays for few wasted rows."""


class PromptLookup:
    """The tokens seen so far and an n-gram search over them. See the module docstring for a call."""

    def __init__(self, tokens: Sequence[int], *, max_ngram: int = MAX_NGRAM, min_ngram: int = MIN_NGRAM) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._buf = np.array(tokens, dtype=np.int64)
        self._len = len(self._buf)
        self._buf = np.resize(self._buf, max(64, 2 * self._len))

    def __len__(self) -> int:
        return self._len

    def push(self, token: int) -> None:
        """Add one token after the others."""
        if self._len == len(self._buf):
            self._buf = np.resize(self._buf, 2 * len(self._buf))
        self._buf[self._len] = token
        self._len += 1

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed an earlier occurrence of the longest suffix
        (``max_ngram`` .. ``min_ngram`` tokens) that occurred before — the latest one with ``limit``
        tokens after it, else the earliest (the most after it) —; [] when none did::

            PromptLookup([1, 2, 3, 4, 1, 2]).propose(5) == [3, 4, 1, 2]
        """
        length, buf = self._len, self._buf
        if limit <= 0:
            return []
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            starts = length - n  # an occurrence starting at i < starts has a token after it
            match = buf[:starts] == buf[starts]
            for j in range(1, n):
                match &= buf[j:starts + j] == buf[starts + j]
            hits = np.flatnonzero(match)
            if hits.size:  # the latest with ``limit`` tokens after it, else the one with the most
                whole = hits[hits + n + limit <= length]
                begin = int(whole[-1] if whole.size else hits[0]) + n
                return [int(t) for t in buf[begin:min(begin + limit, length)]]
        return []


@dataclass
class DraftBudget:
    """Whether to draft now, and how much: ``size`` tokens while drafts confirm ``GOOD_DRAFT`` tokens,
    ``small`` after one that confirmed fewer; and after a draft the model refused at once the next
    chances are skipped (backing off 1, 2, 4 … ``MAX_BACKOFF``; a draft it accepted any of ends the
    back-off)::

        budget = DraftBudget(); size = budget.take(left=100); budget.update(size, accepted=2)
    """

    size: int = MAX_DRAFT
    small: int = SMALL_DRAFT
    skip: int = 0
    backoff: int = 1
    going_well: bool = True
    """The last draft confirmed ``GOOD_DRAFT`` tokens (or all of it)."""

    def take(self, left: int) -> int:
        """The size of a draft now (0: do not draft), at most ``left``."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        return max(0, min(self.size if self.going_well else self.small, left))

    def update(self, drafted: int, accepted: int) -> None:
        """Learn from a finished draft."""
        if drafted <= 0:
            return
        self.going_well = accepted >= min(GOOD_DRAFT, drafted)
        if accepted == 0:
            self.skip, self.backoff = self.backoff, min(MAX_BACKOFF, 2 * self.backoff)
        else:
            self.backoff = 1


DraftCap = Callable[[], int]
"""``cap()``: the most drafted tokens the next feed may carry now (the slot's share of a step it
shares with other sessions: ``PagedSlot.draft_cap``)."""
DraftOutcome = Callable[[int, int], None]
"""``outcome(drafted, accepted)``: a draft ended (``PagedSlot.draft_outcome``)."""


class Drafts:
    """One call's drafts: propose, verify in the pending tokens' feed, confirm or trim. No I/O:
    its methods are generators of the model steps they need (``token_steps``), which the decode
    loop's driver runs.

    The loop feeds through ``feed(pending, left)`` instead of its plain feed, chooses from
    ``logits`` when set, and tells ``accept(token)`` every token it takes (True: already fed)::

        drafts = Drafts(PromptLookup(prompt))
        yield from drafts.feed(pending, left)       # a FeedRowsStep (or a FeedStep: no draft)
        fed = yield from drafts.accept(token)       # a TrimStep when the draft ends here
    """

    def __init__(self, lookup: PromptLookup, budget: DraftBudget | None = None, cap: DraftCap | None = None,
                 outcome: DraftOutcome | None = None) -> None:
        self.lookup = lookup
        self.budget = budget if budget is not None else DraftBudget()
        self._cap = cap
        self._outcome = outcome
        self.ahead: list[int] = []
        """Drafted tokens fed but not chosen yet, in order."""
        self._rows: np.ndarray | None = None
        self._row = 0
        self._draft_len = self._hits = 0
        self.in_kv = 0
        """Generated tokens the KV log holds beyond the prompt, drafted ones ahead included."""
        self.drafted = 0
        """Tokens proposed (``GenerationMetrics.drafted_tokens``)."""
        self.accepted = 0
        """Drafted tokens the model chose too (``GenerationMetrics.accepted_tokens``)."""
        self._early = 0  # tokens ``lookahead`` pushed that ``accept`` has not seen yet

    @property
    def logits(self) -> np.ndarray | None:
        """float32 ``[vocab]`` to choose the next token from while a verify's rows are current
        (None: the log's last logits are)."""
        return None if self._rows is None else self._rows[self._row]

    def feed(self, pending: list[int], left: int) -> Generator[ModelStep, Any, None]:
        """Feed ``pending`` (accepted, not fed; not empty) and a draft of at most ``left`` tokens
        after it in one step, keeping the logits from the last pending token on."""
        draft = self.next_draft(left)
        if not draft:
            yield FeedStep(pending)
            self.in_kv += len(pending)
            return
        yield from self.verify(pending, draft)

    def next_draft(self, left: int) -> list[int]:
        """The draft to feed after the pending tokens now, at most ``left`` tokens ([]: feed them
        alone; this chance to draft is spent): ``draft = drafts.next_draft(left)``."""
        size = self.budget.take(left)
        draft = self.lookup.propose(size) if size > 0 else []
        if draft and self._cap is not None:  # NOTE: asked only with a draft: asking marks a drafter
            size = min(size, self._cap())
            draft = draft[:size] if size > 0 else []
        # NOTE: padded to the size asked for, one verify shape (MAX_DRAFT). A lookup is short only
        # when its match ran into the log's end, where the log goes on repeating what it found
        return draft + [draft[i % len(draft)] for i in range(size - len(draft))] if draft else []

    def lookahead(self, token: int) -> bool:
        """A run of one-token steps chose ``token`` (``RunStep``), which the loop takes later: it
        joins the lookup now (``accept`` does not add it again), and this is its chance to draft,
        as feeding it one by one would be. True when a draft would follow it (the run ends there,
        and the loop's next feed drafts): ``ends = lambda t: t in stop or drafts.lookahead(t)``."""
        self.lookup.push(token)
        self._early += 1
        if self.budget.skip > 0:
            self.budget.skip -= 1
            return False
        return bool(self.lookup.propose(1))

    def _ended(self) -> None:
        """The current draft ended: the budget learns from it, and so does whoever asked (``outcome``)."""
        self.budget.update(self._draft_len, self._hits)
        if self._outcome is not None:
            self._outcome(self._draft_len, self._hits)

    def verify(self, pending: list[int], draft: list[int]) -> Generator[ModelStep, Any, None]:
        """Feed ``pending`` and ``draft`` (``next_draft``) in one step, keeping the rows of logits
        the loop chooses from next."""
        self._rows = yield FeedRowsStep([*pending, *draft], len(draft) + 1)
        self._row, self.ahead, self._draft_len, self._hits = 0, draft, len(draft), 0
        self.in_kv += len(pending) + len(draft)
        self.drafted += len(draft)

    def accept(self, token: int) -> Generator[ModelStep, Any, bool]:
        """The loop took ``token`` (chosen or forced); True when it was the next drafted token (fed
        already). Another token ends the draft: what was drafted after it leaves the KV log."""
        if self._early:
            self._early -= 1
        else:
            self.lookup.push(token)
        if not self.ahead:
            self._rows = None
            return False
        if token == self.ahead[0]:
            del self.ahead[0]
            self._row += 1
            self._hits += 1
            self.accepted += 1
            if not self.ahead:
                self._ended()
            return True
        self._ended()
        yield TrimStep(self.in_kv - len(self.ahead))
        self.in_kv -= len(self.ahead)
        self.forget_ahead()
        return False

    def forget_ahead(self) -> None:
        """Drop the draft's bookkeeping (the caller trims its tokens from the KV log)."""
        self.ahead, self._rows = [], None
