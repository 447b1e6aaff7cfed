"""Token choice from numpy logits: penalties, constraint masks, greedy / temperature / top-k /
top-p / min-p sampling, log-softmax, and stop-string matching for streamed text.

Pure functions over ``float32 [vocab]`` arrays; nothing here knows about OpenVINO::

    rng = make_rng(config.seed)
    token = sample_next(logits, config, rng, context_ids=prompt, generated_ids=out)

``sample_next`` is ``draw(target_distribution(...), rng)``: the distribution a token is drawn from
(what a speculative check of a drafted token must compare with) and the draw, one code path for
both. The order of operations is fixed: penalties → allowed mask → greedy argmax
(``temperature == 0``) or temperature → top-k → top-p → min-p → draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentkv.engine.base import GenerationConfig
from agentkv.errors import ConstraintError, UserError

__all__ = ["StopStringMatcher", "TokenDistribution", "apply_penalties", "draw", "log_softmax", "make_rng",
           "sample_next", "target_distribution", "token_logprobs"]

# NOTE: the nucleus is usually a few dozen tokens; argsorting all 49k probabilities costs ~3 ms,
# so top-p first sorts only the best _NUCLEUS_FIRST_TRY tokens and falls back to a full sort.
_NUCLEUS_FIRST_TRY = 256


def make_rng(seed: int | None) -> np.random.Generator:
    """A generator for ``sample_next``: ``make_rng(7)`` always draws the same tokens; ``None``
    seeds from the OS."""
    return np.random.default_rng(seed)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Numerically stable log-probabilities over the last axis, float32.

    ``log_softmax(np.zeros((2, 4)))`` is ``log(0.25)`` everywhere. A row of only ``-inf``
    stays ``-inf`` (no NaN).
    """
    x = np.asarray(logits, dtype=np.float32)  # [..., vocab]
    peak = np.max(x, axis=-1, keepdims=True)  # [..., 1]
    peak = np.where(np.isfinite(peak), peak, np.float32(0.0))
    shifted = x - peak
    total = np.sum(np.exp(shifted), axis=-1, keepdims=True)  # [..., 1]
    with np.errstate(divide="ignore"):
        log_total = np.where(total > 0, np.log(total), np.float32(0.0))
    return (shifted - log_total).astype(np.float32, copy=False)


def token_logprobs(logits: np.ndarray, token_id: int, top: int) -> tuple[float, np.ndarray, np.ndarray]:
    """(log-probability of ``token_id``, the ``top`` most likely ids, their log-probabilities)
    under the model's distribution: the log-softmax of the raw ``float32 [vocab]`` logits, before
    penalties, masks, temperature and top-k/top-p (what OpenAI reports). Most likely first (ties:
    lower id first), so under greedy sampling the chosen token is the first.

    ``token_logprobs(logits, 7, 3)`` → ``(-0.4, array([7, 2, 9]), array([-0.4, -1.6, -2.2]))``
    """
    scores = log_softmax(np.asarray(logits, dtype=np.float32).reshape(-1))  # [vocab]
    k = max(0, min(int(top), scores.shape[0]))
    if k == 0:
        return float(scores[token_id]), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    cut = scores.shape[0] - k
    best = np.argpartition(scores, cut)[cut:] if cut > 0 else np.arange(scores.shape[0])  # [k], unordered
    best = best[np.lexsort((best, -scores[best]))]  # most likely first, then lower id
    return float(scores[token_id]), best.astype(np.int64), scores[best]


def penalties_active(config: GenerationConfig) -> bool:
    """True when the config penalises repeated tokens (the choice then depends on what came before):
    ``penalties_active(GenerationConfig(repetition_penalty=1.2))`` → True."""
    return (
        config.repetition_penalty != 1.0
        or config.presence_penalty != 0.0
        or config.frequency_penalty != 0.0
    )


def apply_penalties(
    logits: np.ndarray,
    context_ids: Sequence[int],
    generated_ids: Sequence[int],
    config: GenerationConfig,
) -> np.ndarray:
    """A new ``float32 [vocab]`` array with the config's penalties applied.

    - ``repetition_penalty`` (CTRL / Hugging Face): every token seen in the prompt or the
      output has its logit divided by the penalty if positive, multiplied if negative.
    - ``presence_penalty`` (OpenAI): subtracted once from every token already generated.
    - ``frequency_penalty`` (OpenAI): subtracted once per occurrence in the generated tokens.

    ``apply_penalties(logits, prompt, out, GenerationConfig(repetition_penalty=1.3))``
    """
    out = np.array(logits, dtype=np.float32, copy=True)  # [vocab]
    vocab = out.shape[-1]
    generated = _valid_ids(generated_ids, vocab)
    if config.repetition_penalty != 1.0:
        # NOTE: bincount + flatnonzero is ~20x faster than np.unique for a 2k-token prompt.
        seen = np.flatnonzero(
            np.bincount(
                np.concatenate([_valid_ids(context_ids, vocab), generated]), minlength=vocab
            )
        )
        values = out[seen]
        penalty = np.float32(config.repetition_penalty)
        out[seen] = np.where(values > 0, values / penalty, values * penalty)
    if config.presence_penalty != 0.0 or config.frequency_penalty != 0.0:
        counts = np.bincount(generated, minlength=vocab)  # [vocab]
        ids = np.flatnonzero(counts)
        out[ids] -= np.float32(config.presence_penalty) + np.float32(
            config.frequency_penalty
        ) * counts[ids].astype(np.float32)
    return out


def _valid_ids(token_ids: Sequence[int], vocab: int) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    # NOTE: a prompt may hold ids the logits do not cover (added special tokens past the
    # model's head size); they cannot be penalised, so they are skipped rather than wrapping.
    return ids[(ids >= 0) & (ids < vocab)]


@dataclass
class TokenDistribution:
    """The distribution ``sample_next`` draws a token from: weights ∝ probabilities over the
    candidates that survived the filters, and the positions each filter kept (mapping a
    candidate back to its token id). Greedy: one candidate, the argmax::

        dist = target_distribution(logits, config); dist.probabilities(len(logits))[token]
    """

    weights: np.ndarray
    """float32 ``[n]``, unnormalised, every entry >= 0 and some > 0."""
    picks: list[np.ndarray]
    """Each filter's kept positions into the previous array, in order (empty: positions are ids)."""
    greedy: bool = False
    """The argmax, taken without a draw."""

    def token(self, position: int) -> int:
        """The token id of candidate ``position``."""
        for positions in reversed(self.picks):
            position = int(positions[position])
        return position

    def token_ids(self) -> np.ndarray:
        """int64 ``[n]``: every candidate's token id."""
        ids = np.arange(self.weights.shape[0])
        for positions in reversed(self.picks):
            ids = positions[ids]
        return ids.astype(np.int64, copy=False)

    def probabilities(self, vocab: int) -> np.ndarray:
        """float64 ``[vocab]`` summing to 1: zero for every token the filters dropped."""
        out = np.zeros(vocab, dtype=np.float64)
        weights = self.weights.astype(np.float64)
        out[self.token_ids()] = weights / weights.sum()
        return out


def target_distribution(
    logits: np.ndarray,
    config: GenerationConfig,
    *,
    context_ids: Sequence[int] = (),
    generated_ids: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> TokenDistribution:
    """What the next token is drawn from for ``logits`` (``float32 [vocab]``, not modified) under
    ``config``: penalties, the ``allowed`` bool ``[vocab]`` mask (grammar), then greedy argmax or
    temperature → top-k → top-p → min-p. Raises ``ConstraintError`` when the mask allows no token
    or does not match the vocabulary size::

        dist = target_distribution(logits, GenerationConfig(temperature=0.7, top_p=0.9))
    """
    scores = np.asarray(logits, dtype=np.float32).reshape(-1)  # [vocab]
    if penalties_active(config):
        scores = apply_penalties(scores, context_ids, generated_ids, config)
    # NOTE: each filter keeps a subset of the previous array; `picks` records the positions it
    # kept, so the drawn position maps back to a token id without a full-vocab arange.
    picks: list[np.ndarray] = []
    values = scores
    allowed_ids = _allowed_ids(allowed, scores.shape[0])  # [n] or None (= every token)
    if allowed_ids is not None:
        values = _keep(values, allowed_ids, picks)
    if config.temperature == 0.0:
        best = np.array([int(np.argmax(values))])
        return TokenDistribution(np.ones(1, dtype=np.float32), [*picks, best], greedy=True)
    if 0 < config.top_k < values.shape[0]:
        # NOTE: top-k on the logits equals top-k on the tempered probabilities (monotone), and
        # doing it first means exp runs over k entries, not the whole vocabulary.
        cut = values.shape[0] - config.top_k
        values = _keep(values, np.argpartition(values, cut)[cut:], picks)
    weights = _tempered_weights(values, config.temperature)  # [n], max 1, unnormalised
    if config.top_p < 1.0:
        weights = _keep(weights, _nucleus(weights, config.top_p), picks)
    if config.min_p > 0.0:
        weights = _keep(weights, np.flatnonzero(weights >= config.min_p * weights.max()), picks)
    return TokenDistribution(weights, picks)


def draw(distribution: TokenDistribution, rng: np.random.Generator) -> int:
    """A token id drawn from ``distribution`` with one ``rng.random()`` (inverse CDF over its
    candidates in order, even when one is left: the stream of draws does not depend on the
    logits; a greedy one draws nothing). Uses ``distribution.weights`` up::

        token = draw(target_distribution(logits, config), rng)
    """
    if distribution.greedy:
        return distribution.token(0)
    return distribution.token(_draw(distribution.weights, rng))


def sample_next(
    logits: np.ndarray,
    config: GenerationConfig,
    rng: np.random.Generator,
    *,
    context_ids: Sequence[int] = (),
    generated_ids: Sequence[int] = (),
    allowed: np.ndarray | None = None,
) -> int:
    """The next token id for ``logits`` (``float32 [vocab]``); deterministic for a seeded ``rng``:
    ``draw(target_distribution(...), rng)``.

    ``allowed`` is a bool ``[vocab]`` mask (grammar constraint); raises ``ConstraintError``
    when it allows no token or does not match the vocabulary size. ``logits`` is not modified.

    ``sample_next(logits, GenerationConfig(temperature=0.7, top_p=0.9), make_rng(0))``
    """
    if config.temperature == 0.0 and allowed is None and not penalties_active(config):
        return greedy_pick(logits)  # what draw(target_distribution) gives
    distribution = target_distribution(logits, config, context_ids=context_ids, generated_ids=generated_ids,
                                       allowed=allowed)
    return draw(distribution, rng)


def greedy_pick(logits: np.ndarray) -> int:
    """The greedy token of logits ``[vocab]`` taken as float32, the lowest id among equals:
    ``greedy_pick(np.array([0.1, 2.0, 2.0]))`` → 1."""
    return int(np.argmax(np.asarray(logits, dtype=np.float32)))


def _keep(values: np.ndarray, positions: np.ndarray, picks: list[np.ndarray]) -> np.ndarray:
    picks.append(positions)
    kept: np.ndarray = values[positions]
    return kept


def _allowed_ids(allowed: np.ndarray | None, vocab: int) -> np.ndarray | None:
    if allowed is None:
        return None
    mask = np.asarray(allowed, dtype=bool).reshape(-1)
    if mask.shape[0] != vocab:
        raise ConstraintError(
            f"the allowed-token mask has {mask.shape[0]} entries but the logits have {vocab}; "
            "build the constraint from the same model's vocabulary"
        )
    ids = np.flatnonzero(mask)
    if ids.size == 0:
        raise ConstraintError(
            "the constraint allows no next token (a dead end in the grammar); "
            "check the schema or grammar accepts what the model has generated so far"
        )
    return ids


def _tempered_weights(values: np.ndarray, temperature: float) -> np.ndarray:
    """``exp((values - max) / temperature)`` in one float32 buffer: probabilities × a constant."""
    peak = values.max()
    if not np.isfinite(peak):
        raise ConstraintError(
            "every candidate token has logit -inf (or the logits hold NaN/inf), so none can be "
            "sampled; check the model's logits and the constraint mask"
        )
    # NOTE: float32 on purpose: float64 exp over 49k entries costs ~1 ms, float32 ~0.1 ms.
    weights = np.subtract(values, peak, dtype=np.float32)
    weights *= np.float32(1.0 / temperature)
    probabilities: np.ndarray = np.exp(weights, out=weights)
    return probabilities


def _nucleus(weights: np.ndarray, top_p: float) -> np.ndarray:
    """Positions of the smallest most-likely set whose mass reaches ``top_p`` of the total."""
    n = weights.shape[0]
    mass = np.float32(top_p) * weights.sum(dtype=np.float32)
    if n > _NUCLEUS_FIRST_TRY:
        cut = n - _NUCLEUS_FIRST_TRY
        head = np.argpartition(weights, cut)[cut:]
        head = head[np.argsort(-weights[head], kind="stable")]  # most likely first
        count = _nucleus_size(weights[head], mass)
        if count <= head.shape[0]:
            return head[:count]
    # NOTE: a flat distribution: sort values (cheaper than argsort) to find the cut-off
    # weight, then keep every token at or above it (equal-weight ties all stay).
    ranked = np.sort(weights)[::-1]  # [n], most likely first
    count = min(_nucleus_size(ranked, mass), n)
    return np.flatnonzero(weights >= ranked[count - 1])


def _nucleus_size(ranked: np.ndarray, mass: np.float32) -> int:
    """Tokens to keep from ``ranked`` (descending): keep one while the mass before it is below
    ``mass``, so the token that crosses it is kept (HF / OpenAI). ``len + 1`` if never reached."""
    cumulative = np.cumsum(ranked)
    return int(np.searchsorted(cumulative, mass, side="left")) + 1


def _draw(weights: np.ndarray, rng: np.random.Generator) -> int:
    """A position drawn with probability ∝ ``weights`` (consumes ``weights``)."""
    cumulative = np.cumsum(weights, out=weights)  # [n], non-decreasing
    total = cumulative[-1]
    # NOTE: side="right" lands on the first entry whose cumulative mass exceeds the target,
    # so a zero-weight token is never drawn; if rounding makes target == total, take the
    # first entry that reaches the total (it too has nonzero weight).
    index = int(np.searchsorted(cumulative, rng.random() * total, side="right"))
    if index >= cumulative.shape[0]:
        index = int(np.searchsorted(cumulative, total, side="left"))
    return index


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back any tail that may start one.

    ``m = StopStringMatcher(["</s>"]); m.feed("ok </")`` → ``("ok ", False)``;
    ``m.feed("s> more")`` → ``("", True)``; ``m.matched == "</s>"``.
    """

    def __init__(self, stop_strings: Sequence[str]) -> None:
        if any(not s for s in stop_strings):
            raise UserError("stop strings must be non-empty; remove '' from stop_strings")
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._held = ""
        self.matched: str | None = None
        """The stop string that ended the text, once one has."""

    @property
    def stopped(self) -> bool:
        """True once a stop string has been seen; later feeds emit nothing."""
        return self.matched is not None

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Add ``text_delta``; return (text safe to emit now, whether a stop string was hit).

        The stop string and everything after it are never emitted.
        """
        if self.stopped:
            return "", True
        buffer = self._held + text_delta
        hit = self._first_match(buffer)
        if hit is not None:
            position, self.matched = hit
            self._held = ""
            return buffer[:position], True
        hold = self._longest_partial_tail(buffer)
        self._held = buffer[len(buffer) - hold :] if hold else ""
        return buffer[: len(buffer) - hold], False

    def flush(self) -> str:
        """Held-back text at the end of generation (empty after a stop)."""
        held, self._held = self._held, ""
        return "" if self.stopped else held

    def _first_match(self, buffer: str) -> tuple[int, str] | None:
        # NOTE: the stop string that *ends* first wins (ties: the one starting first), as it
        # would in a character-by-character stream: the result never depends on how the
        # text was split into deltas.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            position = buffer.find(stop)
            if position >= 0:
                key = (position + len(stop), position, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _longest_partial_tail(self, buffer: str) -> int:
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
