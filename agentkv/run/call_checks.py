"""What a conversation carries from one model call to the next for the checks around them: the
cache break an operation left for the next call to report, the operations log, and — sampled —
the self-check after a call.

A ``Conversation`` owns one ``CallChecks`` (``conversation.call_checks``); the runner asks it::

    found = conversation.call_checks.break_before(agent, conversation.kv.tokens, prompt, tokenizer)
    describe_call(span, result.metrics, found)                  # the call's figures on its span
    checked = await conversation.call_checks.after_call(conversation.engine, conversation.kv, prompt,
                                                        call_index, result.metrics, found, label=conversation.id)
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from agentkv.agent import Agent
from agentkv.chat.render import RenderedPrompt
from agentkv.engine.base import Engine, KVSession, Tokenizer
from agentkv.engine.generation import GenerationMetrics
from agentkv.observe import tracing
from agentkv.observe.cache_breaks import CacheBreak, Cause, agent_shape, find_break
from agentkv.observe.self_check import SelfCheckResult, check_call

logger = logging.getLogger("agentkv.run.loop")


@dataclass
class CallChecks:
    """The per-model-call check state of one conversation:
    ``CallChecks(self_check=0.05).note("rewind before message 4")``."""

    self_check: float = 0.0
    """Fraction of the conversation's model calls that self-check mode checks."""
    pending_break: CacheBreak | None = None
    """KV dropped before the next model call (a rewind, a compaction's realign, a restore that
    fell short), reported by that call (``agentkv.observe.cache_breaks``)."""
    next_cause: Cause | None = None
    """What the runner knows will make the next call's prompt leave the KV."""
    last_shape: tuple[str, str] | None = None
    """``agent_shape`` of the last model call's agent (a change names the cause of a break)."""
    operations: list[str] = field(default_factory=list)
    """What happened to the KV since the last self-check (reported with a violation)."""

    def note(self, operation: str) -> None:
        """Log an operation on the KV (``checks.note("compaction by Truncation: 900 → 600 tokens")``)."""
        self.operations.append(operation)

    def expect(self, cause: Cause) -> None:
        """Name the cause of the break the next model call will report, if it reports one:
        ``checks.expect("window compaction")``."""
        self.next_cause = cause

    def hold(self, found: CacheBreak) -> None:
        """Keep ``found`` for the next model call to report (the first held break wins):
        ``checks.hold(conversation_break)``."""
        if self.pending_break is None:
            self.pending_break = found

    def take_operations(self) -> tuple[str, ...]:
        """The operations since the last check, cleared (a violation reports them):
        ``ops = checks.take_operations()``."""
        taken = tuple(self.operations)
        self.operations.clear()
        return taken

    def break_before(self, agent: Agent, held: Sequence[int], prompt: RenderedPrompt,
                     tokenizer: Tokenizer) -> CacheBreak | None:
        """Where this call's ``prompt`` leaves the KV log ``held``, and why (what dropped KV
        before the call — a rewind, a compaction's realign — reported its own break first):
        ``found = checks.break_before(agent, kv.tokens, prompt, renderer.tokenizer)``."""
        shape = agent_shape(agent.instructions, agent.tool_schemas if agent.tool_choice != "none" else [])
        before, self.last_shape = self.last_shape, shape
        found, self.pending_break = self.pending_break, None
        cause, self.next_cause = self.next_cause, None
        if found is not None:
            return found
        if cause is None and before is not None and before != shape:
            cause = "instructions changed" if before[0] != shape[0] else "tool schemas changed"
        return find_break(held, prompt, tokenizer, cause=cause)

    async def after_call(self, engine: Engine, kv: KVSession, prompt: RenderedPrompt, call_index: int,
                         m: GenerationMetrics, found: CacheBreak | None, *, label: str) -> SelfCheckResult | None:
        """Log the call in the operations; when self-check mode samples it, check it (logged
        under ``label``; the operations start again after a passed check):
        ``checked = await checks.after_call(engine, kv, prompt, 0, metrics, None, label="c1")``."""
        self.note(f"call {call_index}: prompt {m.prompt_tokens} tokens, reused {m.reused_tokens}, prefix cache "
                  f"{m.prefix_cache_tokens}, prefilled {m.prefilled_tokens}, generated {m.generated_tokens}"
                  + (f"; {found.describe()}" if found is not None else ""))
        if not self.self_check or random.random() >= self.self_check:
            return None
        checked = await check_call(engine, kv, prompt.token_ids, call_index)
        if checked.passed:
            logger.info("conversation %s: %s", label, checked.describe())
            self.operations.clear()
        else:
            logger.warning("conversation %s: %s; operations since the last check: %s", label, checked.describe(),
                           "; ".join(self.operations))
        return checked


def describe_call(span: tracing.Span, m: GenerationMetrics, found: CacheBreak | None) -> None:
    """The call's figures as attributes of its span: ``describe_call(span, result.metrics, None)``."""
    span.set(prompt_tokens=m.prompt_tokens, reused_tokens=m.reused_tokens, prefix_cache_tokens=m.prefix_cache_tokens,
             prefilled_tokens=m.prefilled_tokens, generated_tokens=m.generated_tokens, ttft_s=m.ttft_s,
             tpot_s=m.tpot_s, kv_tokens=m.kv_tokens, kv_bytes=m.kv_bytes, forced_tokens=m.forced_tokens,
             drafted_tokens=m.drafted_tokens, accepted_tokens=m.accepted_tokens, steps_saved=m.steps_saved,
             model_steps=m.model_steps or None,
             cache_break=found.describe() if found is not None else None,
             cache_break_cause=found.cause if found is not None else None)
