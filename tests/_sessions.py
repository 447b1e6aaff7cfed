"""Session helpers the model tests share: what a fresh session computes, to compare a kept one with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


async def one_pass_logits(engine: Any, tokens: Sequence[int]) -> np.ndarray:
    """Next-token logits after ``tokens`` prefilled in one pass by a fresh session of ``engine``:
    ``reference = await one_pass_logits(engine, session.tokens)``."""
    session = await engine.open_session()
    try:
        await session.prefill(tokens)
        return await session.next_token_logits()
    finally:
        await session.close()
