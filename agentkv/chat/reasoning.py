"""A reasoning model's thinking (``<think>…</think>``) kept apart from its answer: split whole,
split while streaming, and allowed before a grammar's answer::

    reasoning, rest = split_reasoning("<think>\\nplan\\n</think>\\n\\nThe answer.", ("<think>", "</think>"))
    # ("plan", "The answer.")
    splitter = ReasoningSplitter(("<think>", "</think>"))
    thought, answer = splitter.feed("<think>\\npl")    # ("pl", "")
    grammar = with_reasoning(HERMES.grammar(tools, "auto"), ("<think>", "</think>"))

The rules (the streaming splitter and ``split_reasoning`` agree on every text, however cut):
only a *leading* block counts (whitespace may precede its open tag); the reasoning is its inside
without the newlines at either end (what Qwen3's template renders back between ``<think>\\n`` and
``\\n</think>``); the answer is what follows the close tag without its leading newlines. A block
never closed is all reasoning (the model was cut while thinking): the answer is empty. A text
that does not open with the tag is all answer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from agentkv.chat.stream_filter import tag_start_at_end
from agentkv.chat.toolcalls import lark_literal

ReasoningTags = tuple[str, str]
"""The open and close tag of a thinking block: ``("<think>", "</think>")``."""

REASONING_RULE = "reasoning"
"""The Lark rule ``with_reasoning`` adds: one thinking block and the blank line after it."""
_ANSWER_RULE = "answer_after_reasoning"
_THINK_RULE = "thinking"


def split_reasoning(text: str, tags: ReasoningTags | None) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a model's output; reasoning None when ``tags`` is None or the
    text does not open with a block (see the module docstring for the rules):
    ``split_reasoning("<think>\\nplan\\n</think>\\n\\nHi", ("<think>", "</think>")) == ("plan", "Hi")``."""
    if tags is None:
        return None, text
    open_tag, close_tag = tags
    body = text.lstrip()
    if not body.startswith(open_tag):
        return None, text
    inside, closed, after = body[len(open_tag):].partition(close_tag)
    return inside.strip("\n"), after.lstrip("\n") if closed else ""


class ReasoningSplitter:
    """Streamed text → (reasoning delta, answer delta) per piece, as ``split_reasoning`` splits
    the whole text; a tag cut across pieces is held back until it is whole::

        splitter = ReasoningSplitter(("<think>", "</think>"))
        splitter.feed("<thi")              # ("", "")
        splitter.feed("nk>\\nplan</think>\\n\\nOK")   # ("plan", "OK")
        splitter.flush()                   # ("", "")
    """

    def __init__(self, tags: ReasoningTags | None) -> None:
        self._tags = tags
        self._state = "start" if tags is not None else "answer"
        self._held = ""
        self._thought = False  # some reasoning went out (its leading newlines are gone)
        self.reasoning: str | None = None
        """All the reasoning so far (None until a block opened)."""

    @property
    def thinking(self) -> bool:
        """True inside a block, and after it until the answer text starts (what comes
        belongs to no answer yet)."""
        return self._state in ("think", "after")

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the answer text ``text`` releases now."""
        if self._state == "answer":
            return "", text
        buffer, self._held = self._held + text, ""
        if self._state == "start":
            return self._start(buffer)
        if self._state == "think":
            return self._think(buffer)
        return self._after(buffer)

    def flush(self) -> tuple[str, str]:
        """What is still held at the end of the stream (a cut tag, trailing newlines)."""
        held, self._held = self._held, ""
        if self._state == "start":
            self._state = "answer"
            return "", held
        if self._state == "think":
            return self._out(held.rstrip("\n")), ""
        return "", ""

    def _start(self, buffer: str) -> tuple[str, str]:
        assert self._tags is not None
        open_tag = self._tags[0]
        body = buffer.lstrip()
        if body.startswith(open_tag):
            self._state, self.reasoning = "think", ""
            return self._think(body[len(open_tag):])
        if open_tag.startswith(body):  # empty, or a cut open tag: wait
            self._held = buffer
            return "", ""
        self._state = "answer"
        return "", buffer

    def _think(self, buffer: str) -> tuple[str, str]:
        assert self._tags is not None
        close_tag = self._tags[1]
        if not self._thought:
            buffer = buffer.lstrip("\n")
        inside, closed, after = buffer.partition(close_tag)
        if closed:
            self._state = "after"
            thought = self._out(inside.rstrip("\n"))
            return thought, self._after(after)[1]
        cut = tag_start_at_end(buffer, close_tag)
        keep = len(buffer) - cut
        keep = len(buffer[:keep].rstrip("\n"))  # newlines that may end the block wait too
        self._held = buffer[keep:]
        return self._out(buffer[:keep]), ""

    def _after(self, buffer: str) -> tuple[str, str]:
        answer = buffer.lstrip("\n")
        if answer:
            self._state = "answer"
        return "", answer

    def _out(self, thought: str) -> str:
        if thought:
            self._thought = True
            self.reasoning = (self.reasoning or "") + thought
        return thought


def with_reasoning(grammar: str, tags: ReasoningTags | None, *, tag_ids: tuple[int, int] | None = None) -> str:
    """``grammar`` (llguidance Lark text with a ``start:`` rule) letting the model first write
    one thinking block, ``OPEN THINK CLOSE "\\n\\n"``, THINK any text up to the first close tag
    (a lazy lexeme); ``grammar`` itself when ``tags`` is None. Free text (a ``TEXT`` terminal)
    then never starts with the open tag. With ``tag_ids`` (the tags are single tokens of the
    vocabulary, as in Qwen3's) the block is written with those tokens, as the template renders it,
    not spelled out in text. THINK is not bounded by the grammar (llguidance's ``max_tokens``
    ends the lexeme without its close tag): ``ThinkingBudget`` closes it:
    ``with_reasoning(HERMES.grammar(tools, "required"), ("<think>", "</think>"))``."""
    if tags is None:
        return grammar
    lines = grammar.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("start:")]
    if len(starts) != 1:
        raise ValueError(f"with_reasoning needs a Lark grammar with one 'start:' rule, got {len(starts)}")
    open_tag, close_tag = tags
    at = starts[0]
    lines[at] = f"{_ANSWER_RULE}:{lines[at][len('start:'):]}"
    # NOTE: llguidance lexes greedily: free text that could start with the open tag would swallow
    # the block (and a call after it), so the answer's TEXT never starts with it.
    lines = [f"{line} & ~/{_regex_literal(open_tag)}(?s:.*)/" if line.startswith("TEXT:") else line
             for line in lines]
    if tag_ids is not None:  # NOTE: the tags as the control tokens the template renders (Qwen3's)
        block = [f'{REASONING_RULE}: <[{tag_ids[0]}]> {_THINK_RULE} <[{tag_ids[1]}]> "\\n\\n"',
                 f"{_THINK_RULE}: /(?s:.*)/"]
    else:
        block = [f'{REASONING_RULE}: {lark_literal(open_tag)} {_THINK_RULE} "\\n\\n"',
                 f"{_THINK_RULE}[lazy]: /(?s:.*){_regex_literal(close_tag)}/"]
    return "\n".join([f"start: {REASONING_RULE}? {_ANSWER_RULE}", *lines, *block]) + "\n"


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it literally (inside Lark's ``/…/``)."""
    return "".join(f"\\x{ord(c):02x}" if c.isascii() and not c.isalnum() else c for c in text)


class ThinkingBudget:
    """A token constraint (``engine.base.TokenConstraint``) that closes a reasoning model's
    thinking block once it holds ``max_tokens`` tokens: from then on only the close tag's id is
    allowed (where the wrapped constraint allows it), so a call ``tool_choice="required"`` forces
    still fits in the call's budget. A block counts only when the answer opens with it:
    ``ThinkingBudget(engine.make_constraint(grammar), think_id, end_think_id, max_tokens=128)``."""

    def __init__(self, inner: Any, open_id: int, close_id: int, *, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.inner, self.open_id, self.close_id, self.max_tokens = inner, open_id, close_id, max_tokens
        self._started = self._thinking = False
        self.thought = 0
        """Tokens written inside the block so far."""

    def allowed_mask(self) -> Any:
        mask = self.inner.allowed_mask()
        if self._thinking and self.thought >= self.max_tokens and bool(mask[self.close_id]):
            closing = np.zeros_like(mask)
            closing[self.close_id] = True
            return closing
        return mask

    def advance(self, token_id: int) -> None:
        self.inner.advance(token_id)
        if not self._started:
            self._started, self._thinking = True, token_id == self.open_id
        elif self._thinking:
            if token_id == self.close_id:
                self._thinking = False
            else:
                self.thought += 1

    def is_finished(self) -> bool:
        return bool(self.inner.is_finished())
