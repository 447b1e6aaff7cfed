"""Beam-search bookkeeping over numpy logits: which beams continue, how the KV batch is
reordered (the stateful model's ``beam_idx``), and which finished hypotheses win.

No model calls happen here. The engine prefills the prompt once (KV batch of 1 row), then::

    search = BeamSearch(config, eos_token_ids, prompt_len=len(prompt))
    logits = last_logits[None, :]                    # [1, vocab]
    while (step := search.step(logits)) is not None:
        logits = infer(input_ids=step.next_tokens[:, None], beam_idx=step.beam_idx)
    best = search.finalize()[0]                      # BeamHypothesis, best first
    winner = search.winner                           # which KV row to keep, and how much of it

Rules (those of openvino-genai's ``GroupBeamSearcher`` with ``num_beam_groups=1``,
``diversity_penalty=0``, ``no_repeat_ngram_size`` unset, ``stop_criteria=HEURISTIC``; read in
``src/cpp/src/sampling/sampler.cpp`` and ``lm_encoding.cpp``):

1. Start: ``num_beams`` beams over the prompt row; the first has score 0, the others ``-inf``
   (so step 1 picks distinct tokens, all from row 0).
2. Each step, every live beam proposes its ``2 × num_beams`` most likely tokens (log-softmax of
   its raw logits); a candidate's score is the beam's summed log-prob plus the token's.
   Candidates are ranked by score (ties: beam order, then token rank, then lower token id).
3. Walking down that ranking: a stop token (EOS, or ``config.stop_token_ids``) at rank
   ``< num_beams`` finishes a hypothesis (its EOS included); one at a lower rank is skipped.
   Other candidates become the next beams until there are ``num_beams`` of them.
4. A finished hypothesis scores ``sum_logprobs / generated_len ** length_penalty`` where
   ``generated_len`` counts the stop token. Only the ``num_beams`` best are kept (on equal
   scores the earlier one stays).
5. Done (HEURISTIC) once ``num_beams`` hypotheses are finished and the worst of them scores at
   least ``best_parent_sum_logprobs / best_parent_len ** length_penalty``, where the best
   parent is the best beam *before* this step's token (as openvino-genai does; HF uses the
   new candidate's score). The children of that step are dropped. Also done when no
   non-stop candidate is left.
6. ``max_new_tokens``: once the beams hold that many tokens, every live beam is finished
   with its own length (reason "length") — those last tokens are chosen but never fed.
7. Result: hypotheses sorted by score, best first, the first ``num_return_sequences``.
   Scores use float32 arithmetic, as openvino-genai does.

Departures: penalties are refused with ``UserError`` (openvino-genai silently ignores them in
beam search); stop strings are not matched here (no tokenizer); ``ignore_eos`` removes the
model's EOS ids from the stop set, while ``config.stop_token_ids`` always stop.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from agentkv.engine.base import GenerationConfig, common_prefix_len
from agentkv.engine.generation import BeamHypothesis
from agentkv.engine.decode.sampling import log_softmax
from agentkv.errors import UserError

__all__ = ["BeamSearch", "BeamStep", "BeamWinner"]


@dataclass(frozen=True)
class BeamStep:
    """What the engine feeds on its next infer call."""

    beam_idx: np.ndarray
    """int32 ``[live_beams]``: the KV row each new beam continues (the model's ``beam_idx``)."""
    next_tokens: np.ndarray
    """int64 ``[live_beams]``: the token each new beam feeds (its row's ``input_ids``)."""


@dataclass(frozen=True)
class BeamWinner:
    """How to collapse the KV batch onto the best hypothesis once the search has ended."""

    token_ids: tuple[int, ...]
    """The winner's generated ids (its stop token included, if one ended it)."""
    row: int
    """The KV batch row (as the last infer left it) that shares the longest prefix with it."""
    kv_len: int
    """Trim that row to this many tokens (prompt + ``common_tokens``); its KV is exact there."""
    common_tokens: int
    """How many leading winner tokens that row's KV holds; the rest must still be fed."""
    finish_reason: str
    """"stop" if the winner ended with a stop token, else "length"."""


@dataclass(frozen=True)
class _Beam:
    tokens: tuple[int, ...]
    score: np.float32
    """Summed log-probabilities of ``tokens``."""
    row: int
    """Row of the KV batch (and of the next logits) that holds this beam."""


@dataclass(frozen=True)
class _Finished:
    tokens: tuple[int, ...]
    score: float
    """Normalised: sum_logprobs / len ** length_penalty."""
    stopped: bool


class BeamSearch:
    """One beam search's state. Not thread-safe; one engine task drives it."""

    def __init__(
        self, config: GenerationConfig, eos_token_ids: frozenset[int], prompt_len: int
    ) -> None:
        if prompt_len < 1:
            raise UserError("beam search needs a prompt of at least one token; prefill it first")
        if (
            config.repetition_penalty != 1.0
            or config.presence_penalty != 0.0
            or config.frequency_penalty != 0.0
        ):
            raise UserError(
                "beam search does not apply repetition/presence/frequency penalties (nor does "
                "openvino-genai); leave them at their defaults with num_beams>1, or use num_beams=1"
            )
        self._config = config
        self._width = config.num_beams
        self._stop_ids = frozenset(config.stop_token_ids) | (
            frozenset() if config.ignore_eos else frozenset(eos_token_ids)
        )
        self._prompt_len = prompt_len
        first = _Beam((), np.float32(0.0), 0)
        others = [_Beam((), np.float32(-np.inf), 0) for _ in range(self._width - 1)]
        self._live: list[_Beam] = [first, *others]
        self._kv_rows: list[tuple[int, ...]] = [()]
        self._finished: list[_Finished] = []
        self._done = config.max_new_tokens == 0

    @property
    def done(self) -> bool:
        """True once ``step`` has returned None (or will)."""
        return self._done

    def step(self, logits: np.ndarray) -> BeamStep | None:
        """Choose the next beams from ``logits`` (``float32 [kv_rows, vocab]``, one row per KV
        batch row, 1 row on the first call). Returns what to feed next, or None when done.

        Assumes every returned ``BeamStep`` is fed before the next call. Mutates the search.
        """
        if self._done:
            return None
        rows = np.asarray(logits, dtype=np.float32)
        rows = rows.reshape(1, -1) if rows.ndim == 1 else rows  # [kv_rows, vocab]
        if rows.ndim != 2 or rows.shape[0] != len(self._kv_rows):
            raise UserError(
                f"beam search expected logits of shape [{len(self._kv_rows)}, vocab], got "
                f"{tuple(rows.shape)}; pass the last position's logits of every KV row"
            )
        candidates = self._rank_candidates(log_softmax(rows))
        children = self._select(candidates)
        best_parent = self._live[0]
        if not children or self._heuristic_done(best_parent):
            self._done = True
            return None
        if len(children[0].tokens) >= self._config.max_new_tokens:
            self._finish(children)
            return None
        # NOTE: after the engine feeds this step, new beam i lives in KV row i.
        self._kv_rows = [child.tokens for child in children]
        self._live = [_Beam(c.tokens, c.score, index) for index, c in enumerate(children)]
        return BeamStep(
            beam_idx=np.array([child.row for child in children], dtype=np.int32),
            next_tokens=np.array([child.tokens[-1] for child in children], dtype=np.int64),
        )

    def finalize(self) -> list[BeamHypothesis]:
        """The best hypotheses, best first, ``num_return_sequences`` of them (fewer only if the
        vocabulary is too small to fill the beams; one empty hypothesis if ``max_new_tokens``
        is 0). If the search was stopped early, live beams are finished as they stand."""
        if not self._done:
            self._finish(self._live)
        ranked = self._ranked()
        if not ranked:
            return [BeamHypothesis(token_ids=(), score=0.0)]
        count = self._config.num_return_sequences
        return [BeamHypothesis(token_ids=f.tokens, score=f.score) for f in ranked[:count]]

    @property
    def winner(self) -> BeamWinner:
        """The best hypothesis and the KV row to collapse onto (call after the search ended).

        If the winner finished several steps ago, no row may hold all of it: the engine keeps
        ``row``, trims it to ``kv_len``, then feeds what it wants of ``token_ids[common_tokens:]``
        (typically all but a final stop token, as in greedy decoding).
        """
        if not self._done:
            raise UserError("the beam search is still running; call finalize() first")
        best = (self._ranked() or [_Finished((), 0.0, False)])[0]
        commons = [common_prefix_len(best.tokens, row) for row in self._kv_rows]
        row = int(np.argmax(commons))
        return BeamWinner(
            token_ids=best.tokens,
            row=row,
            kv_len=self._prompt_len + commons[row],
            common_tokens=commons[row],
            finish_reason="stop" if best.stopped else "length",
        )

    def _rank_candidates(self, logprobs: np.ndarray) -> list[tuple[_Beam, int, np.float32]]:
        """Every live beam's best ``2 × num_beams`` tokens, ranked by summed score."""
        per_beam = min(2 * self._width, logprobs.shape[1])
        beams, tokens, scores = [], [], []
        for beam in self._live:
            row = logprobs[beam.row]  # [vocab]
            top = np.argpartition(-row, per_beam - 1)[:per_beam]
            top = top[np.lexsort((top, -row[top]))]  # most likely first, then lower id
            beams.extend([beam] * per_beam)
            tokens.append(top)
            scores.append(beam.score + row[top])  # float32, as openvino-genai sums
        flat_scores = np.concatenate(scores)
        flat_tokens = np.concatenate(tokens)
        order = np.argsort(-flat_scores, kind="stable")
        return [(beams[i], int(flat_tokens[i]), flat_scores[i]) for i in order]

    def _select(self, candidates: list[tuple[_Beam, int, np.float32]]) -> list[_Beam]:
        """Finish stop-token candidates of rank < num_beams; return up to num_beams children."""
        children: list[_Beam] = []
        for rank, (parent, token, score) in enumerate(candidates):
            tokens = (*parent.tokens, token)
            if token in self._stop_ids:
                if rank < self._width:
                    self._add_finished(tokens, score, stopped=True)
                continue
            children.append(_Beam(tokens, np.float32(score), parent.row))
            if len(children) == self._width:
                break
        return children

    def _heuristic_done(self, best_parent: _Beam) -> bool:
        if len(self._finished) < self._width:
            return False
        worst = min(f.score for f in self._finished)
        with np.errstate(divide="ignore", invalid="ignore"):
            # NOTE: on the first step the parent is empty: 0 / 0 is NaN and never "done",
            # exactly as in openvino-genai's float arithmetic.
            attainable = best_parent.score / np.power(
                np.float32(len(best_parent.tokens)), np.float32(self._config.length_penalty)
            )
        return bool(worst >= attainable)

    def _finish(self, beams: list[_Beam]) -> None:
        """Finish ``beams`` as they stand (reason "length") and end the search."""
        for beam in beams:
            if beam.tokens:
                self._add_finished(beam.tokens, beam.score, stopped=False)
        self._done = True

    def _add_finished(self, tokens: tuple[int, ...], score: np.float32, *, stopped: bool) -> None:
        with np.errstate(divide="ignore", invalid="ignore"):
            normalised = np.float32(score) / np.power(
                np.float32(len(tokens)), np.float32(self._config.length_penalty)
            )
        self._finished.append(_Finished(tokens, float(normalised), stopped))
        if len(self._finished) > self._width:
            worst = min(range(len(self._finished)), key=lambda i: (self._finished[i].score, -i))
            del self._finished[worst]

    def _ranked(self) -> list[_Finished]:
        return sorted(self._finished, key=lambda f: -f.score)

