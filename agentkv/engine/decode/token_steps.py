"""TokenSteps: one generate call's token loop as a generator of model steps and deltas, no I/O.

The loop chooses a token, streams its text, stops, and asks for the model steps that feed
tokens back; a driver runs those steps and sends their results in. The async driver
(``loop.run_steps``) awaits each step in a worker thread; the threaded one
(``threaded.run_steps_in_thread``) runs the whole loop in one worker thread and only hands deltas
to the event loop. Both run this one loop::

    steps = TokenSteps(choose, config=cfg, decode_text=tok.decode, stop_ids={2}, max_new=64)
    run = steps.run(); reply = None
    while True:
        item = run.send(reply)        # FeedStep / FeedRowsStep / TrimStep, a TokenDelta, then the outcome
        reply = execute(item) if isinstance(item, MODEL_STEPS) else None

Each chosen token that does not end generation is fed (and joins the session's log); the token
that ends it is not fed — the next turn's alignment feeds it if the rendered history contains
it. Tokens a grammar forces are taken without sampling and fed with the token before them as one
chunk (``fast_forward``); with ``drafts`` (``prompt_lookup``) those feeds carry a guess of the
next tokens and a token the draft fed already is not fed again. With ``pick`` (the token plain
decoding would choose from given logits: no constraint, penalties or log-probabilities), a feed
that drafts nothing is a run instead (``RunStep``): the model steps on, each step feeding the
token ``pick`` chose from the last, up to ``config.decode_run`` tokens, and the loop then takes them in
order (one delta each), the run's tokens already fed. ``settle(keep)`` gives the steps that leave
one-by-one decoding's log when a driver stops the loop early. No OpenVINO here.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentkv.engine.base import GenerationConfig, TokenConstraint
from agentkv.engine.generation import TokenDelta, TokenLogprob
from agentkv.engine.decode.detokenize import IncrementalDecoder
from agentkv.engine.decode.fast_forward import FastForwardCounts, ForcingConstraint, next_forced
from agentkv.engine.decode.model_steps import FeedStep, ModelStep, RunStep, TrimStep
from agentkv.engine.decode.prompt_lookup import Drafts
from agentkv.engine.decode.sampling import StopStringMatcher


@dataclass(frozen=True)
class DecodeOutcome:
    """How a decode loop ended."""

    generated: list[int]
    text: str
    finish_reason: str
    first_token_at: float | None


StepsRun = Generator["ModelStep | TokenDelta | DecodeOutcome", Any, None]
"""What ``TokenSteps.run`` yields: model steps (send their result back), deltas, then the outcome."""


class TokenSteps:
    """One call's token loop (see the module docstring for how a driver runs it).

    ``choose(generated)`` picks the next id (from ``drafts.logits`` while a verify's rows are
    current); ``score(id)`` (when log-probabilities are asked for) reads the chosen id's
    log-probability from the same logits, before the feed. With ``forcing`` (the constraint, when
    it fast-forwards: ``fast_forward.forced_source``) a token it forces is taken without
    ``choose`` (``on_forced()`` then stands for the draw the sampler would have made), and
    accepted tokens are fed only when the model must choose again or the loop ends. With
    ``pick(logits)`` (what ``choose`` would give from those logits, for any ``generated``), feeds
    that draft nothing run on (``RunStep``). ``counts`` adds up forced tokens and feeds."""

    def __init__(
        self,
        choose: Callable[[list[int]], int],
        *,
        config: GenerationConfig,
        decode_text: Callable[[Sequence[int]], str],
        stop_ids: frozenset[int],
        max_new: int,
        constraint: TokenConstraint | None = None,
        score: Callable[[int], TokenLogprob] | None = None,
        forcing: ForcingConstraint | None = None,
        counts: FastForwardCounts | None = None,
        on_forced: Callable[[], None] | None = None,
        drafts: Drafts | None = None,
        pick: Callable[[np.ndarray], int] | None = None,
    ) -> None:
        self._choose, self._score, self._on_forced = choose, score, on_forced
        self._pick = pick
        self._chosen: deque[int] = deque()  # tokens a run chose that the loop has not taken yet
        self._run_fed = 0  # of those, the ones the run fed (all but its last)
        self._ran = False
        self._config, self._stop_ids, self._max_new = config, stop_ids, max_new
        self._constraint, self._forcing, self.drafts = constraint, forcing, drafts
        self._decode_text = decode_text
        self.counts = counts if counts is not None else FastForwardCounts()
        self._pending: list[int] = []  # accepted tokens not fed yet
        self._held = 0  # generated tokens one-by-one decoding has in the KV or pending now
        self._done = False

    @property
    def kept(self) -> int:
        """Generated tokens one-by-one decoding's KV log holds now: what ``settle`` keeps."""
        return self._held - len(self._pending)

    def run(self) -> StepsRun:
        """The loop: yields model steps (send each one's result back), a ``TokenDelta`` per token
        (text never splits a UTF-8 character), then the ``DecodeOutcome``."""
        decoder = IncrementalDecoder(self._decode_text)
        stopper = StopStringMatcher(list(self._config.stop_strings))
        counts, drafts, constraint = self.counts, self.drafts, self._constraint
        generated: list[int] = []
        pieces: list[str] = []
        first_at: float | None = None
        finish = "length"
        while len(generated) < self._max_new:
            token = next_forced(self._forcing)
            run_fed = False
            if token is None:
                if self._pending and not self._chosen:
                    yield from self._feed_pending(len(generated))
                if self._chosen:
                    token, run_fed = self._chosen.popleft(), self._run_fed > 0
                    self._run_fed -= run_fed
                else:
                    token = self._choose(generated)
            else:
                counts.forced += 1
                if self._on_forced is not None:
                    self._on_forced()
            if first_at is None:
                first_at = time.perf_counter()
            generated.append(token)
            fed = False
            if drafts is not None:
                fed = yield from drafts.accept(token)
            if constraint is not None:
                constraint.advance(token)
            if token in self._stop_ids:
                finish = "stop"
                break
            logprob = self._score(token) if self._score is not None else None
            text, stopped = stopper.feed(decoder.push(token))
            pieces.append(text)
            yield TokenDelta(token, text, logprob)
            if stopped:
                finish = "stop_string"
                break
            if constraint is not None and constraint.is_finished():
                finish = "constraint"
                break
            if len(generated) == self._max_new:
                break
            self._held += 1
            if fed:
                counts.confirmed += 1
            elif not run_fed:
                self._pending.append(token)
        yield from self._settle_ahead()
        if self._pending:  # NOTE: the tokens before the one that ended generation, as one-by-one would have fed
            yield from self._feed_pending(len(generated), draft=False)
        self._done = True
        if finish == "stop_string":
            finish = "stop"
        else:
            tail, _ = stopper.feed(decoder.flush())
            tail += stopper.flush()
            if tail:
                pieces.append(tail)
                yield TokenDelta(generated[-1] if generated else -1, tail)
        yield DecodeOutcome(generated, "".join(pieces), finish, first_at)

    def settle(self, keep: int | None = None) -> Generator[ModelStep, Any, None]:
        """The step that leaves ``keep`` generated tokens in the KV log and no draft ahead, for a
        driver that stops ``run`` early (the stream closed or cancelled, a step failed). Default:
        ``kept``, one-by-one decoding's log now, and nothing once ``run`` has ended; a driver that
        ran ahead of its consumer passes the ``kept`` of the last event the consumer received.
        The trim is asked for even when the counts say nothing is ahead: a failed step may have
        fed part of its chunks (the trim is a no-op on a log that holds no more)."""
        if keep is None:
            if self._done:
                return
            keep = self.kept
        self._done = True
        if self.drafts is not None:
            self.drafts.forget_ahead()
        yield TrimStep(keep)

    def _settle_ahead(self) -> Generator[ModelStep, Any, None]:
        """At the loop's end: a draft or a run ahead, and a drafted or run token that ended
        generation, leave the KV log (one-by-one decoding never fed them)."""
        self._chosen.clear()
        if self.drafts is not None:
            self.drafts.forget_ahead()
        if self._ran or (self.drafts is not None and self.drafts.in_kv > self.kept):
            yield TrimStep(self.kept)  # NOTE: nothing to do when the log holds no more
            if self.drafts is not None:
                self.drafts.in_kv = self.kept

    def _feed_pending(self, generated: int, *, draft: bool = True) -> Generator[ModelStep, Any, None]:
        """Feed the accepted tokens not fed yet (with a draft after them unless ``draft`` is off);
        they stay pending until the step has run."""
        pending, left = list(self._pending), self._max_new - generated - 1
        guess = self.drafts.next_draft(left) if self.drafts is not None and draft else []
        if guess:
            assert self.drafts is not None
            yield from self.drafts.verify(pending, guess)
        elif self._pick is not None and draft and left > 0 and self._config.decode_run > 1:
            yield from self._run(pending, min(self._config.decode_run, left + 1))
            return
        else:
            yield FeedStep(pending)
            if self.drafts is not None:
                self.drafts.in_kv += len(pending)
        self._pending = []
        self.counts.fed_in(len(pending))

    def _run(self, pending: list[int], steps: int) -> Generator[ModelStep, Any, None]:
        """Feed ``pending`` as a run choosing up to ``steps`` tokens; they wait in ``_chosen``."""
        assert self._pick is not None
        stop_ids, drafts = self._stop_ids, self.drafts
        if drafts is None:
            def ends(token: int) -> bool:
                return token in stop_ids
        else:
            def ends(token: int) -> bool:
                return token in stop_ids or drafts.lookahead(token)
        chosen: list[int] = yield RunStep(pending, steps, self._pick, ends, greedy=self._config.greedy)
        self._ran = True
        self._pending = []
        self._chosen.extend(chosen)
        self._run_fed = len(chosen) - 1
        self.counts.fed += len(pending) + len(chosen) - 1
        self.counts.feeds += len(chosen)
        if drafts is not None:
            drafts.in_kv += len(pending) + len(chosen) - 1
