"""A fake grammar the decode-loop tests share: a mask that forbids a token and forces a run."""

from __future__ import annotations

import numpy as np


class NoZeroAndForcedPair:
    """A grammar over ``vocab`` tokens: token 0 is never allowed, and a 5 forces 3 then 4 after it
    (``NoZeroAndForcedPair(12)``: what ``TokenConstraint`` and fast-forward ask of a grammar)."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.queue: list[int] = []

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(self.vocab, dtype=bool)
        if self.queue:
            mask[self.queue[0]] = True
        else:
            mask[1:] = True
        return mask

    def advance(self, token_id: int) -> None:
        assert self.allowed_mask()[token_id], "the loop took a token the grammar forbids"
        self.queue = self.queue[1:] if self.queue else ([3, 4] if token_id == 5 else [])

    def is_finished(self) -> bool:
        return False

    def forced_tokens(self) -> list[int]:
        return list(self.queue)
