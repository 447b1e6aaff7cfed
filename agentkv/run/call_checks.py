"""What the runner notes around each model call of a conversation: the cache break before it, its
figures on the call's span, the operations log, and — sampled — the self-check after it.

::

    found = cache_break_before(session, agent, prompt)        # before the call
    describe_call(span, result.metrics, found)                # on its tracing span
    checked = await after_call(session, prompt, step, result.metrics, found)   # a SelfCheckResult or None
"""

from __future__ import annotations

import logging
import random

from agentkv.observe import tracing
from agentkv.agent import Agent
from agentkv.observe.cache_breaks import CacheBreak, agent_shape, find_break
from agentkv.chat.render import RenderedPrompt
from agentkv.run.conversation import Conversation
from agentkv.engine.base import GenerationMetrics
from agentkv.observe.self_check import SelfCheckResult, check_call

logger = logging.getLogger("agentkv.run.loop")


def cache_break_before(session: Conversation, agent: Agent, prompt: RenderedPrompt) -> CacheBreak | None:
    """Where this call's prompt leaves the KV its session holds, and why (what dropped KV before
    the call — a rewind, a compaction's realign — reported its own break first)."""
    shape = agent_shape(agent.instructions, agent.tool_schemas if agent.tool_choice != "none" else [])
    before, session.last_shape = session.last_shape, shape
    found, session.pending_break = session.pending_break, None
    cause, session.next_break_cause = session.next_break_cause, None
    if found is not None:
        return found
    if cause is None and before is not None and before != shape:
        cause = "instructions changed" if before[0] != shape[0] else "tool schemas changed"
    return find_break(session.kv.tokens, prompt, session.renderer.tokenizer, cause=cause)


def describe_call(span: tracing.Span, m: GenerationMetrics, found: CacheBreak | None) -> None:
    """The call's figures as attributes of its span."""
    span.set(prompt_tokens=m.prompt_tokens, reused_tokens=m.reused_tokens, prefix_cache_tokens=m.prefix_cache_tokens,
             prefilled_tokens=m.prefilled_tokens, generated_tokens=m.generated_tokens, ttft_s=m.ttft_s,
             tpot_s=m.tpot_s, kv_tokens=m.kv_tokens, kv_bytes=m.kv_bytes,
             cache_break=found.describe() if found is not None else None,
             cache_break_cause=found.cause if found is not None else None)


async def after_call(session: Conversation, prompt: RenderedPrompt, step: int, m: GenerationMetrics,
                     found: CacheBreak | None) -> SelfCheckResult | None:
    """Log the call in the session's operations; when self-check mode samples it, check it
    (logged; the operations start again after a check)."""
    session.operations.append(f"call {step}: prompt {m.prompt_tokens} tokens, reused {m.reused_tokens}, prefix cache "
                              f"{m.prefix_cache_tokens}, prefilled {m.prefilled_tokens}, generated {m.generated_tokens}"
                              + (f"; {found.describe()}" if found is not None else ""))
    if not session.self_check or random.random() >= session.self_check:
        return None
    checked = await check_call(session.engine, session.kv, prompt.token_ids, step)
    if checked.passed:
        logger.info("session %s: %s", session.id, checked.describe())
        session.operations.clear()
    else:
        logger.warning("session %s: %s; operations since the last check: %s", session.id, checked.describe(),
                       "; ".join(session.operations))
    return checked
