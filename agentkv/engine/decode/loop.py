"""The decode loop of one generate call: the engine's side of ``token_steps.TokenSteps``.

``DecodeLoop`` builds a call's token loop (the sampler, the scorer, forced tokens, prompt-lookup
drafts) and runs it: in one worker thread when the backend allows it (``threaded``), or here,
one model step per ``await`` (``run_steps``: the scripted engine's paced fake steps). Every engine
shares it: the stateful and paged engines choose tokens by sampling the model's logits, the
scripted engine from its script; beam search has its own loop (``beam_decode``). No OpenVINO here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, aclosing
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, cast

import anyio
import anyio.lowlevel

from agentkv.engine.base import GenerationConfig, TokenConstraint, Tokenizer
from agentkv.engine.generation import (
    BeamHypothesis,
    GenerationMetrics,
    GenerationResult,
    TokenDelta,
    TokenLogprob,
    TopLogprob,
)
from agentkv.engine.decode.alignment import Alignment
from agentkv.engine.decode.beam_decode import run_beam_search
from agentkv.engine.decode.fast_forward import FastForwardCounts, ForcingConstraint, forced_source
from agentkv.engine.decode.prompt_lookup import Drafts, PromptLookup
from agentkv.engine.decode.sampling import greedy_pick, make_rng, penalties_active, sample_next, token_logprobs
from agentkv.engine.decode.step_counts import StepCounts
from agentkv.engine.decode.threaded import current_task_id, run_steps_in_thread
from agentkv.engine.decode.model_steps import MODEL_STEPS, FeedRowsStep, ModelStep, RunStep, TrimStep
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from agentkv.kv.log import feeds_rows

if TYPE_CHECKING:
    import numpy as np
    from anyio.lowlevel import EventLoopToken

    from agentkv.kv.log import KVLog, KVSlot, RowsSlot


class DecodeBackend(Protocol):
    """What a decode loop reads of the backend its session works through (``SlotBackend``)."""

    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_context_len(self) -> int: ...
    def metrics_for(self, log: KVLog, align: Alignment, *, generated: int, ttft: float,
                    tpot: float) -> GenerationMetrics: ...
    def room(self, slot: KVSlot | None, tokens: int, *, rows: int = 1,
             rewrite: bool = False) -> AbstractAsyncContextManager[None]: ...
    def room_blocking(self, slot: KVSlot | None, tokens: int, *, token: EventLoopToken,
                      before_wait: Callable[[], None] | None = None) -> AbstractContextManager[None]: ...
    @property
    def decodes_in_thread(self) -> bool: ...

logger = logging.getLogger(__name__)

RunBlocking = Callable[..., Awaitable[Any]]
"""``await run(fn, *args)``: a session's way to run a blocking step in a worker thread."""


def step_counts(slot: object) -> StepCounts | None:
    """A copy of the slot's model-step counts, or None when its engine does not count steps."""
    counts = getattr(slot, "steps", None)
    return counts.copy() if isinstance(counts, StepCounts) else None


def with_steps(metrics: GenerationMetrics, slot: object, before: StepCounts | None) -> GenerationMetrics:
    """``metrics`` with the model steps ``slot`` ran in since ``before`` (unchanged without counts)."""
    now = step_counts(slot)
    if before is None or now is None:
        return metrics
    spent = now.since(before)
    return replace(metrics, model_steps=spent.steps, mean_batch=spent.mean_batch, queued_s=spent.queued_s)


def stop_ids_for(config: GenerationConfig, eos_token_ids: frozenset[int]) -> frozenset[int]:
    """Ids that end generation: the config's stop ids, plus EOS unless ``ignore_eos``."""
    return frozenset(config.stop_token_ids) | (frozenset() if config.ignore_eos else eos_token_ids)


async def run_steps(steps: TokenSteps, execute: Callable[[ModelStep], Awaitable[Any]]
                    ) -> AsyncGenerator[TokenDelta | DecodeOutcome, None]:
    """Drive ``steps`` on the event loop, awaiting ``execute(step)`` for each model step (in a
    worker thread): a ``TokenDelta`` per token, then the outcome. However the stream ends (closed,
    cancelled, a step failed), the KV log then holds what one-by-one decoding's would, settled
    shielded from the cancellation; a settle that fails too is logged and the first error goes on.
    Skipped when another task closes this (an abandoned generator finalized later, after its caller
    let the slot go: the next alignment trims the tail then)::

        async for event in run_steps(TokenSteps(choose, config=cfg, ...), execute):
            ...
    """
    run = steps.run()
    owner = current_task_id()
    try:
        reply: Any = None
        while True:
            try:
                item = run.send(reply)
            except StopIteration:
                return
            if isinstance(item, MODEL_STEPS):
                reply = await execute(item)
            else:
                reply = None
                yield item
                # NOTE: before the loop goes on: a run's or a draft's next delta needs no model step
                # (no await) and the loop's ``kept`` would count this token once it does
                await anyio.lowlevel.checkpoint_if_cancelled()
    finally:
        run.close()
        if owner is not None and current_task_id() == owner:
            with anyio.CancelScope(shield=True):
                await settle_or_log(steps.settle(), execute)


async def settle_or_log(settle: Iterator[ModelStep], execute: Callable[[ModelStep], Awaitable[Any]]) -> None:
    """Run a loop's settle steps. Only a loop stopped early (closed, cancelled, a step failed) has
    any, so a failing settle is logged and the error or cancellation that stopped it goes on (the
    next alignment trims the log): ``await settle_or_log(steps.settle(), execute)``."""
    try:
        for step in settle:
            await execute(step)
    except Exception:
        logger.exception("settling the KV log after a decode loop stopped early failed; the first error follows")


def timing(started: float, first_at: float | None, generated: int) -> tuple[float, float]:
    """(TTFT, TPOT) in seconds from the call's start and its first token's time."""
    now = time.perf_counter()
    first = first_at if first_at is not None else now
    tpot = (now - first) / (generated - 1) if generated > 1 else 0.0
    return first - started, tpot


class DecodeLoop:
    """One generation on an aligned KV log (its last logits follow the prompt); ``run()``
    yields deltas, then the result. ``run_blocking`` runs each model step in a worker thread."""

    def __init__(
        self,
        engine: DecodeBackend,
        log: KVLog,
        slot: KVSlot,
        run_blocking: RunBlocking,
        prompt: list[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None,
        align: Alignment,
        started: float,
        steps_before: StepCounts | None = None,
    ) -> None:
        """``steps_before``: the slot's step counts before the call's alignment (the metrics
        then count the prefill's steps too; default: from now)."""
        self.engine, self.log, self.slot, self.run_blocking = engine, log, slot, run_blocking
        self.steps_before = steps_before if steps_before is not None else step_counts(slot)
        self.prompt = prompt
        self.config, self.constraint = config, constraint
        self.align, self.started = align, started
        self.metrics: GenerationMetrics | None = None
        self.stop_ids = stop_ids_for(config, self.engine.eos_token_ids)
        self.max_new = max(0, min(config.max_new_tokens, self.engine.max_context_len - len(prompt)))
        self.fast_forward = FastForwardCounts()
        self._rng: np.random.Generator | None = None
        self.drafts: Drafts | None = None

    async def run(self) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Yield a ``TokenDelta`` per token, then the ``GenerationResult``."""
        if self.config.num_beams > 1:
            result = await run_beam_search(self)
            yield TokenDelta(result.token_ids[-1] if result.token_ids else -1, result.text)
            yield result
            return
        async with aclosing(self.run_sequential()) as events:  # closing run() settles a draft at once
            async for event in events:
                yield event

    async def run_sequential(self) -> AsyncGenerator[TokenDelta | GenerationResult, None]:
        """Tokens from ``chooser()``, or forced by the constraint: a delta per token, then the
        result. The token loop runs in one worker thread when the backend allows it
        (``threaded.run_steps_in_thread``: no thread hop per token), else step by step here."""
        self.drafts = self.make_drafts()
        steps = TokenSteps(
            self.chooser(), config=self.config, decode_text=self.engine.tokenizer.decode, stop_ids=self.stop_ids,
            max_new=self.max_new, constraint=self.constraint, score=self.scorer(), forcing=self.forcing(),
            counts=self.fast_forward, on_forced=self.skip_draw, drafts=self.drafts, pick=self.picker(),
        )
        base = len(self.log)
        if self.engine.decodes_in_thread:
            events = run_steps_in_thread(steps, self.blocking_executor(base))
        else:
            events = run_steps(steps, self.executor(base))
        async with aclosing(events):
            async for event in events:
                if isinstance(event, DecodeOutcome):
                    yield self.finish(event.generated, event.text, event.finish_reason, event.first_token_at)
                else:
                    yield event

    def executor(self, base: int) -> Callable[[ModelStep], Awaitable[Any]]:
        """``await execute(step)``: one model step of the token loop, run in a worker thread with
        room made for it (``base``: the log's length before the first generated token)."""
        log, slot, run = self.log, self.slot, self.run_blocking

        async def execute(step: ModelStep) -> Any:
            if isinstance(step, TrimStep):
                if len(log) > base + step.keep:
                    await run(log.trim, slot, base + step.keep)
                return None
            async with self.engine.room(slot, len(step.ids)):  # a run's later steps take free blocks or end it
                if isinstance(step, RunStep):
                    return await run(partial(log.feed_run, slot, step.ids, steps=step.steps, choose=step.choose,
                                             ends=step.ends, greedy=step.greedy, started=step.started))
                if isinstance(step, FeedRowsStep):
                    return await run(log.feed_rows, slot, step.ids, step.rows)
                await run(log.feed, slot, step.ids)
                return None

        return execute

    def blocking_executor(self, base: int) -> Callable[[ModelStep], Any]:
        """``execute(step)`` for a worker thread: ``executor``'s step run in the calling thread,
        the room made there too (the event loop only when blocks must be freed first)."""
        log, slot = self.log, self.slot
        token = anyio.lowlevel.current_token()

        def execute(step: ModelStep) -> Any:
            if isinstance(step, TrimStep):
                log.trim(slot, base + step.keep)
                return None
            started = step.started if isinstance(step, RunStep) else None
            with self.engine.room_blocking(slot, len(step.ids), token=token, before_wait=started):
                if isinstance(step, RunStep):
                    return log.feed_run(slot, step.ids, steps=step.steps, choose=step.choose, ends=step.ends,
                                        greedy=step.greedy, started=step.started)
                if isinstance(step, FeedRowsStep):
                    return log.feed_rows(cast("RowsSlot", slot), step.ids, step.rows)
                log.feed(slot, step.ids)
                return None

        return execute

    def chooser(self) -> Callable[[list[int]], int]:
        """``choose(generated)``: the next token, sampled from the log's last logits under the
        config (and the constraint's mask)."""
        log, cfg = self.log, self.config
        rng = self.call_rng()

        def choose(generated: list[int]) -> int:
            # NOTE: while a draft is ahead, log.tokens holds drafted tokens too; the penalties'
            # token set is the same (a draft is copied from the prompt and the generated tokens).
            # A sampled draw from a verify row is the speculative rule (``prompt_lookup.Drafts``).
            logits = self.drafts.logits if self.drafts is not None else None
            logits = logits if logits is not None else log.last_logits
            assert logits is not None
            allowed = self.constraint.allowed_mask() if self.constraint is not None else None
            return sample_next(logits, cfg, rng, context_ids=log.tokens, generated_ids=generated, allowed=allowed)

        return choose

    def picker(self) -> Callable[[np.ndarray], int] | None:
        """``pick(logits)``: the token ``chooser()`` gives from ``logits`` whatever came before —
        greedy or sampled, with no constraint, penalties or log-probabilities —, so the model may
        run several steps choosing by it (``RunStep``); None when ``chooser()`` needs more (then
        every token goes through it)."""
        cfg = self.config
        if self.constraint is not None or cfg.logprobs is not None or penalties_active(cfg) \
                or type(self).chooser is not DecodeLoop.chooser:
            return None
        if cfg.greedy:
            return greedy_pick
        rng = self.call_rng()

        def pick(logits: np.ndarray) -> int:
            return sample_next(logits, cfg, rng)

        return pick

    def call_rng(self) -> np.random.Generator:
        """The call's one random stream (seeded by the config), which ``chooser()`` and
        ``picker()`` draw from in token order."""
        if self._rng is None:
            self._rng = make_rng(self.config.seed)
        return self._rng

    def forcing(self) -> ForcingConstraint | None:
        """The constraint to take forced tokens from (``fast_forward.forced_source``), or None."""
        if type(self).chooser is not DecodeLoop.chooser:
            # NOTE: a loop that chooses tokens itself (the scripted engine replays its script)
            # must be asked for every token, forced or not.
            return None
        return forced_source(self.constraint, self.config)

    def make_drafts(self) -> Drafts | None:
        """Prompt-lookup drafts for this call (``decode/prompt_lookup.py``), or None: off unless the
        config asks for them without log-probabilities or beams (greedy or sampled), the slot
        returns several positions' logits (paged), and the loop chooses by the logits (not a script)."""
        cfg = self.config
        if not (cfg.prompt_lookup and cfg.logprobs is None and cfg.num_beams == 1) \
                or not feeds_rows(self.slot) or type(self).chooser is not DecodeLoop.chooser:
            return None
        cap, outcome = getattr(self.slot, "draft_cap", None), getattr(self.slot, "draft_outcome", None)
        return Drafts(PromptLookup(self.log.tokens), cap=cap if callable(cap) else None,
                      outcome=outcome if callable(outcome) else None)

    def skip_draw(self) -> None:
        """Stand for the draw sampling would have made for a forced token (its mask allowed only
        it): a seeded sampled call then draws the same tokens with fast-forward on or off."""
        if self._rng is not None and not self.config.greedy:
            self._rng.random()

    def scorer(self) -> Callable[[int], TokenLogprob] | None:
        """``score(token)``: the token's log-probability and the config's number of alternatives,
        from the log's last logits (``sampling.token_logprobs``); None when not asked for."""
        top = self.config.logprobs
        if top is None:
            return None
        log, decode = self.log, self.engine.tokenizer.decode

        def score(token: int) -> TokenLogprob:
            assert log.last_logits is not None
            logprob, ids, values = token_logprobs(log.last_logits, token, top)
            alternatives = tuple(TopLogprob(int(i), decode([int(i)]), float(v)) for i, v in zip(ids, values))
            return TokenLogprob(token, decode([token]), logprob, alternatives)

        return score

    def finish(
        self,
        generated: list[int],
        text: str,
        finish: str,
        first_at: float | None,
        beams: tuple[BeamHypothesis, ...] = (),
    ) -> GenerationResult:
        """Build the result and the metrics."""
        ttft, tpot = timing(self.started, first_at, len(generated))
        self.metrics = replace(with_steps(
            self.engine.metrics_for(self.log, self.align, generated=len(generated), ttft=ttft, tpot=tpot),
            self.slot, self.steps_before), forced_tokens=self.fast_forward.forced,
            steps_saved=self.fast_forward.steps_saved, drafted_tokens=self.drafts.drafted if self.drafts else 0,
            accepted_tokens=self.drafts.accepted if self.drafts else 0)
        return GenerationResult(
            token_ids=tuple(generated), text=text, finish_reason=finish, metrics=self.metrics, beams=beams
        )
