"""Why a model call reused less KV than its conversation held: where the rendered prompt left the
KV session's token log, in which message and part, the tokens on both sides, and the cause.

The runner checks each call (``find_break``); operations that drop KV before a call (rewind, a
restore that did not cover the history) leave a ``CacheBreak`` on the conversation for the next
call to report. A break arrives as a ``CacheBroken`` event, in ``RunResult.cache_breaks`` and on
the CLI's ``--metrics`` line::

    async for event in runtime.run_stream(conversation, "hi"):
        if event.type == "cache_broken":
            print(event.cache_break.describe())
    # → "reused 412 of 530 tokens: message 3 (assistant) content differs — cause: window compaction"
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from agentkv.engine.base import common_prefix_len

if TYPE_CHECKING:
    from agentkv.chat.render import MessageSpan, RenderedPrompt
    from agentkv.engine.base import Tokenizer

Part = Literal["system prompt", "tool schemas", "content", "tool-call arguments", "template markup"]
Cause = Literal["window compaction", "rewind", "edit", "instructions changed", "tool schemas changed",
                "re-render drift", "partial restore", "retry of a cut tool call", "unknown"]
EXCERPT_TOKENS = 8
"""Tokens shown on each side of a break."""
TOOLS_MARKER = "You can call these tools"


@dataclass(frozen=True)
class CacheBreak:
    """Where and why a call's prompt left the KV the conversation held."""

    position: int
    """The 0-based index of the first prompt token the KV did not hold: the tokens before it
    were reused, the KV's from it on were discarded."""
    held: int
    """Tokens the KV held before the call (for a restore that fell short: the tokens the newest
    snapshot held, or the history's when there was none)."""
    message_index: int | None
    """The rendered message the position falls in — 0 is the system message when the agent has
    instructions, then the window's messages (None: before the first, or after the last)."""
    role: str | None
    """The role of that message ("system", "user", "assistant", "tool"); for a message the KV held
    past the prompt's end, the role its header names. None when ``message_index`` is None."""
    part: Part
    """Which part of the prompt differs: "system prompt", "tool schemas", "content",
    "tool-call arguments", or "template markup" (role headers and end markers, the generation prompt)."""
    kv_excerpt: str
    """What the KV held from the position on (detokenised, a few tokens)."""
    prompt_excerpt: str
    """What the prompt has there instead ("" when the prompt ends there)."""
    cause: Cause
    """What the runtime knows made the prompt leave the KV: "window compaction", "rewind", "edit"
    (a fork at an edited message), "instructions changed", "tool schemas changed", "partial restore"
    (a resume's snapshot covered less of the history), "retry of a cut tool call"; else
    "re-render drift" when both sides spell the same text in other tokens, else "unknown"."""

    @property
    def discarded(self) -> int:
        """Tokens the KV held past the position, computed again by this call."""
        return max(0, self.held - self.position)

    def as_json(self) -> dict[str, object]:
        """The break as JSON: its fields, ``discarded`` and the ``describe`` line as ``summary``."""
        return {**dataclasses.asdict(self), "discarded": self.discarded, "summary": self.describe()}

    def describe(self) -> str:
        """One line for logs and the CLI."""
        where = f"message {self.message_index} ({self.role})" if self.message_index is not None else "the prefix"
        return (f"cache break at token {self.position} of {self.held}: {where} {self.part} differs "
                f"({self.kv_excerpt!r} held, {self.prompt_excerpt!r} now) — cause: {self.cause}")


def agent_shape(instructions: str | None, tool_schemas: Sequence[object]) -> tuple[str, str]:
    """Digests of an agent's instructions and of the tool schemas it renders (a change of either
    moves the prompt's first tokens)."""
    def digest(value: object) -> str:
        return hashlib.blake2b(json.dumps(value, sort_keys=True, default=str).encode(), digest_size=8).hexdigest()
    return digest(instructions), digest(list(tool_schemas))


def find_break(held: Sequence[int], prompt: RenderedPrompt, tokenizer: Tokenizer, *,
               cause: Cause | None = None) -> CacheBreak | None:
    """The break between the KV's log ``held`` and ``prompt``, or None when the prompt starts
    with everything the KV held. ``cause``: what the caller knows happened."""
    position = common_prefix_len(held, prompt.token_ids)
    if position >= len(held):
        return None
    return locate(position, held, prompt, tokenizer, cause=cause)


def locate(position: int, held: Sequence[int], prompt: RenderedPrompt, tokenizer: Tokenizer, *,
           cause: Cause | None = None) -> CacheBreak:
    """A ``CacheBreak`` at ``position``: its message, part and excerpts; the cause given, else
    "re-render drift" when both sides spell the same text, else "unknown"."""
    span = next((s for s in prompt.spans if s.start <= position < s.end), None)
    kv_side = tokenizer.decode(list(held[position: position + EXCERPT_TOKENS]))
    prompt_side = tokenizer.decode(list(prompt.token_ids[position: position + EXCERPT_TOKENS]))
    after_last = bool(prompt.spans) and position >= prompt.spans[-1].end
    index: int | None
    role: str | None
    part: Part
    if span is None and after_last and kv_side.startswith("<|im_start|>"):
        # the KV held a message the prompt no longer has (rewound, edited away)
        index, role, part = len(prompt.spans), kv_side.removeprefix("<|im_start|>").split("\n")[0] or None, "content"
    elif span is None:
        before = tokenizer.decode(list(prompt.token_ids[:position]))
        part = "tool schemas" if TOOLS_MARKER in before + prompt_side else (
            "system prompt" if position < prompt.prefix_len else "template markup")
        index, role = None, None
    else:
        index, role = span.index, span.role
        part = _part_in(tokenizer.decode(list(prompt.token_ids[span.start: position])), role, prompt_side)
    if cause is None:
        cause = "re-render drift" if span is not None and _same_text(held, prompt, span, tokenizer) else "unknown"
    return CacheBreak(position, len(held), index, role, part, kv_side, prompt_side, cause)


def _part_in(before: str, role: str, prompt_side: str) -> Part:
    """The part of a message whose text up to the break is ``before``."""
    if "\n" not in before:  # still in the role header
        return "template markup"
    if role == "system":
        return "tool schemas" if TOOLS_MARKER in before else "system prompt"
    if "<tool_call>" in before:
        return "tool-call arguments"
    if prompt_side.startswith(("<|im_end|>", "<|im_start|>")):
        return "template markup"
    return "content"


def _same_text(held: Sequence[int], prompt: RenderedPrompt, span: MessageSpan, tokenizer: Tokenizer) -> bool:
    """True when the KV holds the message's text in other tokens (a re-tokenised message)."""
    start, end = span.start, span.end
    now = tokenizer.decode(list(prompt.token_ids[start:end]))
    then = tokenizer.decode(list(held[start:end]))
    shared = min(len(now), len(then))  # NOTE: the KV may end inside the message (its last token unfed)
    return shared > 0 and now[:shared] == then[:shared] and list(held[start:end]) != list(prompt.token_ids[start:end])
