"""FakeSlot: a KV backend without a model, so scripted tests run the real session code.

The scripted engine's sessions are the engine's own ``SlotSession`` s: alignment, trim, fork,
offload, snapshot / restore and RoPE span drops run unchanged over this slot. Its KV is small
and checkable: one layer, one head, two dimensions per token. A token's key is a unit vector
at the token's own phase rotated by its position (RoPE with one pair at 1 radian per
position), its value is ``[token id, 1]``. Logits are a deterministic function of the tokens
the *values* name, so a snapshot restored into the wrong place changes what the "model"
says, and a drop that re-rotated later keys wrongly fails at the next step::

    slot = FakeSlot(vocab_size=100_279)
    logits = slot.feed(np.array([[5, 6, 7]]), past_len=0)    # [1, vocab]
    keys, values = slot.read()                                # [1, 1, 1, 3, 2] each
    assert held_tokens(values) == [5, 6, 7]
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence

import numpy as np

from agentkv.errors import KVLogCorrupt, SnapshotIncompatible, UserError

HEAD_DIM = 2
"""Dimensions of a fake key or value: one rotated pair."""
KV_BYTES_PER_TOKEN = 2 * HEAD_DIM * 4
"""One float32 key and value of ``HEAD_DIM`` each: the ``[1, 1, 1, T, 2]`` snapshot layout."""
RADIANS_PER_POSITION = 1.0
"""The fake RoPE's one frequency (``θ^0`` for any θ, as for a real pair 0)."""
ROPE_THETA = 10_000.0
"""The θ the fake model's metadata reports (its one pair turns at ``θ^0 = 1`` rad/position)."""
KEY_TOLERANCE = 1e-4
"""Largest error accepted between a held key and its token's rotation at its position
(float32 rounding after re-rotations is ~1e-6)."""
_GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


def fake_keys(tokens: Sequence[int], first_position: int) -> np.ndarray:
    """float32 ``[T, 2]`` keys of ``tokens`` at positions ``first_position..``."""
    ids = np.asarray(tokens, dtype=np.float64)
    angle = (ids * _GOLDEN % 1.0) * 2 * math.pi + RADIANS_PER_POSITION * (
        first_position + np.arange(len(ids), dtype=np.float64))
    return np.stack([np.cos(angle), np.sin(angle)], axis=-1).astype(np.float32)


def fake_logits(tokens: Sequence[int] | np.ndarray, vocab_size: int) -> np.ndarray:
    """Deterministic float32 logits ``[vocab_size]`` of a token log: equal logs, equal logits
    (four spikes placed by a hash of the log; zeros elsewhere)."""
    digest = hashlib.blake2b(np.asarray(tokens, dtype="<i8").tobytes(), digest_size=16).digest()
    logits = np.zeros(vocab_size, dtype=np.float32)
    for rank, index in enumerate(np.frombuffer(digest, dtype="<u4")):
        logits[int(index) % vocab_size] = float(4 - rank)
    return logits


def held_tokens(values: np.ndarray) -> list[int]:
    """The token ids fake values ``[..., T, 2]`` name (first layer, row, head)."""
    return [int(v) for v in values.reshape(-1, values.shape[-2], HEAD_DIM)[0, :, 0]]


class FakeSlot:
    """One sequence's fake KV; honours the ``KVSlot`` contract of ``kv/log.py``.

    ``pace(n)`` gives the seconds a step over ``n`` tokens takes (slept in the calling worker
    thread), so tests can make a "model" slow.
    """

    def __init__(self, vocab_size: int, pace: Callable[[int], float] | None = None) -> None:
        self.vocab_size = vocab_size
        self._pace = pace
        self._keys = np.zeros((0, HEAD_DIM), dtype=np.float32)
        self._values = np.zeros((0, HEAD_DIM), dtype=np.float32)
        self._offset = 0  # position of the first held token (a RoPE probe prefills at an offset)
        self._unchecked = False  # KV was written from outside: check it before the next step

    def feed(
        self, input_ids: np.ndarray, past_len: int, beam_idx: np.ndarray | None = None, position_offset: int = 0
    ) -> np.ndarray:
        """Append ``input_ids`` ``[1, T]`` after ``past_len`` held positions; logits ``[1, vocab]``
        of the whole held log. Raises ``KVLogCorrupt`` if written KV does not match its tokens."""
        ids = np.asarray(input_ids)
        if ids.shape[0] != 1 or (beam_idx is not None and list(np.asarray(beam_idx)) != [0]):
            raise UserError("the fake KV holds one sequence: beam search is scripted, not run on it")
        if past_len != len(self._keys):
            raise KVLogCorrupt(f"fed after {past_len} positions but the fake slot holds {len(self._keys)}")
        if past_len == 0:
            self._offset = position_offset
        if self._unchecked:
            self._check_keys()
        tokens = [int(t) for t in ids[0]]
        seconds = self._pace(len(tokens)) if self._pace is not None else 0.0
        if seconds > 0:
            time.sleep(seconds)
        new_values = np.stack([np.asarray(tokens, dtype=np.float32), np.ones(len(tokens), np.float32)], axis=-1)
        self._keys = np.concatenate([self._keys, fake_keys(tokens, self._offset + past_len)])
        self._values = np.concatenate([self._values, new_values])
        return fake_logits(self._values[:, 0].astype(np.int64), self.vocab_size)[None, :]

    def length(self) -> int:
        return len(self._keys)

    def reset(self) -> None:
        self._keys, self._values = self._keys[:0], self._values[:0]
        self._offset, self._unchecked = 0, False

    def trim(self, n: int) -> None:
        """Keep the first ``n`` positions."""
        self._keys, self._values = self._keys[:n], self._values[:n]

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """float32 K and V ``[1, 1, 1, T, 2]`` (copies)."""
        return self._keys.copy()[None, None, None], self._values.copy()[None, None, None]

    def write(self, keys: np.ndarray, values: np.ndarray) -> None:
        """Replace the KV by ``keys`` / ``values`` ``[1, 1, 1, T, 2]``; checked at the next step."""
        if keys.shape != values.shape or keys.shape[:3] != (1, 1, 1) or keys.shape[-1] != HEAD_DIM:
            raise SnapshotIncompatible(f"the fake KV is [1, 1, 1, T, {HEAD_DIM}], got keys {keys.shape} and "
                                       f"values {values.shape}: restore a snapshot made by a ScriptedEngine")
        self._keys = np.array(keys[0, 0, 0], dtype=np.float32)
        self._values = np.array(values[0, 0, 0], dtype=np.float32)
        self._offset, self._unchecked = 0, True

    def select_row(self, row: int, n: int) -> None:
        """Keep row ``row`` (only row 0 exists) and its first ``n`` positions."""
        if row != 0:
            raise UserError("the fake KV holds one sequence (row 0)")
        self.trim(n)

    def _check_keys(self) -> None:
        """Every held key must be its token's rotation at its position (a wrong RoPE shift, or
        KV restored in the wrong order, is caught here)."""
        self._unchecked = False
        if not len(self._keys):
            return
        expected = fake_keys(held_tokens(self._values), self._offset)
        error = np.abs(expected - self._keys).max(axis=-1)
        if float(error.max()) > KEY_TOLERANCE:
            position = int(error.argmax())
            raise KVLogCorrupt(
                f"the fake KV's key at position {position} (token {held_tokens(self._values)[position]}) is off "
                f"by {float(error.max()):.2e} from its token's rotation there: the KV was dropped or "
                "restored with keys at the wrong positions"
            )
