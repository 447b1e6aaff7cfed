"""Render a conversation to token ids, prefix-stably, recording each message's token span.

::

    renderer = ChatRenderer(engine.tokenizer)
    prompt = renderer.render([Message.system("Be brief."), Message.user("hi")], tools=[schema])
    prompt.token_ids, prompt.spans[1].start, prompt.prefix_len, prompt.generation_prompt_len

How the ids are built (rendering messages[:k] always gives a prefix of rendering messages[:k+1]):

- A message's *segment* is the text the chat template adds for it: template(messages[:i+1]) minus
  template(messages[:i]). It depends only on messages[:i+1] and is tokenised on its own, so what
  follows a message never changes its ids. Segments are cached by a hash of the whole prefix.
- The *synthetic prefix* is rendered text that belongs to no message: the default system prompt a
  template injects when messages[0] is not a system message (SmolLM2's "You are a helpful AI
  assistant named SmolLM…"), or the system message created to carry the tools text. It comes
  first, lies in no span (span 0 starts after it) and ``prefix_len`` covers it, so dropping
  message 0 never drops a system prompt, and a re-render after the drop re-injects the same ids.
- Assistant messages with ``token_ids`` render verbatim: header ids + token_ids + footer ids; a
  footer starting with the EOS the generated ids already end with does not repeat it.
- Tool calls without ``token_ids`` render as the content plus one ``<tool_call>`` block per call
  (``toolcalls.format_tool_calls``, the format ``parse_tool_calls`` reads back).
- Tool results render as role "tool" when the template shows their content verbatim; when it
  raises, or rewrites the content (openvino-genai's template polyfill turns it into JSON in a
  user turn), they render as a user turn ``<tool_response>\\n…\\n</tool_response>``.
- Tools: ``tools_text(tools)`` is appended to the leading system message (a new one if there is
  none); the template's native ``tools=`` is used only if its source mentions ``tools``.
- A template that is not prefix-stable on a probe conversation is replaced by the default ChatML
  rendering (a warning is logged); a single message the template cannot render (it raises, or
  its rendering is not an extension of the shorter one) is rendered in ChatML, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from cachetools import LRUCache

from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.toolcalls import format_tool_calls
from agentkv.engine.base import Tokenizer
from agentkv.errors import UserError

logger = logging.getLogger(__name__)

CHATML_GENERATION_PROMPT = "<|im_start|>assistant\n"
_SENTINEL = "AGENTKV_GENERATED_CONTENT_7F3C"
_PROBE_SYSTEM: dict[str, Any] = {"role": "system", "content": "You are a test."}
_PROBE_TOOL_CONTENT = 'tool "result"\nline 2'


@dataclass(frozen=True)
class MessageSpan:
    """Where one message's tokens are in a rendered prompt."""

    index: int
    """Position of the message in the rendered list."""
    role: str
    """The message's role (``"tool"`` even when rendered as a user turn)."""
    start: int
    """First token of the message (inclusive)."""
    end: int
    """One past its last token."""

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class RenderedPrompt:
    """A conversation as token ids: synthetic prefix, one span per message, generation prompt."""

    token_ids: tuple[int, ...]
    spans: tuple[MessageSpan, ...]
    """One per message, in order, contiguous; from the end of the synthetic prefix to the start
    of the generation prompt."""
    prefix_len: int
    """End of the leading system message (tools text included) or of the synthetic prefix; 0 if
    neither exists. The ids every conversation of the same agent starts with."""
    generation_prompt_len: int
    """Tokens of the trailing assistant header (0 without a generation prompt)."""


def default_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """An instruction, one JSON schema per line, and the ``<tool_call>`` format to call them."""
    example = format_tool_calls([ToolCall(name="<tool name>", arguments={"<argument>": "<value>"})])
    return "\n".join(
        [
            "You can call these tools (one JSON schema per line):",
            *(json.dumps(tool, ensure_ascii=False) for tool in tools),
            "To call a tool, answer with one block per call, each on its own lines:",
            example,
        ]
    )


def chatml_segment(role: str, content: str) -> str:
    """The default (fallback) ChatML text for one message."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@dataclass(frozen=True)
class _Entry:
    """One message as the template sees it."""

    payload: dict[str, Any]
    """The dict passed to the template."""
    index: int | None
    """Position in the caller's list; None for the system message created for the tools text."""
    role: str
    token_ids: tuple[int, ...] | None


@dataclass(frozen=True)
class _Segment:
    synthetic: tuple[int, ...]
    """Ids of the injected text that belongs to no message (only ever at position 0)."""
    own: tuple[int, ...]
    """Ids of the message itself (or of the generation prompt)."""


class ChatRenderer:
    """Renders messages with a tokenizer's chat template; see the module docstring for the rules."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tools_text: Callable[[Sequence[dict[str, Any]]], str] | None = None,
        cache_size: int = 4096,
    ) -> None:
        self.tokenizer = tokenizer
        self.tools_text = tools_text or default_tools_text
        self._cache: LRUCache[bytes, _Segment] = LRUCache(maxsize=cache_size)
        source = str(getattr(tokenizer, "chat_template", "") or "")
        self.native_tools = bool(re.search(r"\btools\b", source))
        """True when the template renders ``tools=`` itself (its source mentions ``tools``)."""
        self.uses_template = self._template_is_prefix_stable()
        """False when the template failed the prefix-stability probe: default ChatML is used."""
        self.native_tool_role = self.uses_template and self._template_shows_tool_content()
        """True when tool results go through the template as role "tool"."""

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] = (),
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        """Token ids and spans for ``messages``: ``renderer.render([Message.user("hi")])``."""
        entries = self._entries(messages, tools)
        native = list(tools) if tools and self.native_tools else None
        digest = hashlib.blake2b(_json(native).encode(), digest_size=16).digest()
        ids: list[int] = []
        spans: list[MessageSpan] = []
        prefix_len = 0
        for position, entry in enumerate(entries):
            digest = _chain(digest, _json([entry.payload, entry.token_ids]))
            segment = self._cached(digest, partial(self._segment, entries, position, native))
            ids += segment.synthetic
            if segment.synthetic:
                prefix_len = len(ids)
            start = len(ids)
            ids += segment.own
            if entry.index is None:  # the system message created for the tools text
                prefix_len = len(ids)
                continue
            spans.append(MessageSpan(entry.index, entry.role, start, len(ids)))
            if entry.index == 0 and entry.role == "system":
                prefix_len = len(ids)
        generation: tuple[int, ...] = ()
        if add_generation_prompt:
            key = _chain(digest, "generation prompt")
            generation = self._cached(key, partial(self._generation_segment, entries, native)).own
        return RenderedPrompt(tuple(ids) + generation, tuple(spans), prefix_len, len(generation))

    def message_tokens(self, message: Message, *, position: int) -> int:
        """Tokens of ``message``'s span at ``position`` (tools text not counted), for budgets:
        ``renderer.message_tokens(Message.user("hi"), position=3)``."""
        if position < 0:
            raise UserError(f"position must be >= 0, got {position}")
        context = [Message.system(_PROBE_SYSTEM["content"])] if position > 0 else []
        prompt = self.render([*context, message], add_generation_prompt=False)
        return len(prompt.spans[-1])

    # -- entries: messages as template dicts -------------------------------------------------

    def _entries(
        self, messages: Sequence[Message], tools: Sequence[dict[str, Any]]
    ) -> list[_Entry]:
        entries = []
        for index, message in enumerate(messages):
            if not isinstance(message, Message):
                kind = type(message).__name__
                raise UserError(f"messages[{index}] is a {kind}; pass Message objects")
            payload = self._payload(message)
            token_ids = message.token_ids if message.role == "assistant" else None
            entries.append(_Entry(payload, index, message.role, token_ids))
        if tools and not self.native_tools:
            text = self.tools_text(tools)
            if entries and entries[0].role == "system":
                first = entries[0]
                content = "\n\n".join(p for p in (first.payload["content"], text) if p)
                entries[0] = _Entry({**first.payload, "content": content}, 0, "system", None)
            else:
                entries.insert(0, _Entry({"role": "system", "content": text}, None, "system", None))
        return entries

    def _payload(self, message: Message) -> dict[str, Any]:
        if message.role == "assistant" and message.tool_calls:
            calls = format_tool_calls(message.tool_calls)
            content = "\n".join(p for p in (message.content, calls) if p)
            return {"role": "assistant", "content": content}
        if message.role == "tool":
            if not self.native_tool_role:
                wrapped = f"<tool_response>\n{message.content}\n</tool_response>"
                return {"role": "user", "content": wrapped}
            payload = {"role": "tool", "content": message.content}
            if message.tool_call_id is not None:
                payload["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                payload["name"] = message.name
            return payload
        return {"role": message.role, "content": message.content}

    # -- segments ----------------------------------------------------------------------------

    def _segment(self, entries: list[_Entry], position: int, tools: list[Any] | None) -> _Segment:
        entry = entries[position]
        dicts = [e.payload for e in entries[: position + 1]]
        if entry.token_ids is not None:
            dicts[-1] = {**dicts[-1], "content": _SENTINEL}
        text = self._segment_text(dicts, tools)
        injected = ""
        if position == 0 and entry.payload["role"] != "system":
            injected, text = self._split_injected(dicts[0], text, tools)
        encode = self.tokenizer.encode
        if entry.token_ids is None:
            return _Segment(tuple(encode(injected)), tuple(encode(text)))
        header, found, footer = text.partition(_SENTINEL)
        if not found:
            logger.warning("the chat template hid an assistant message's content; using ChatML")
            header, _, footer = chatml_segment("assistant", _SENTINEL).partition(_SENTINEL)
        footer_ids = encode(footer)
        eos = self.tokenizer.eos_token_id
        if entry.token_ids[-1:] == (eos,) and footer_ids[:1] == [eos]:
            footer_ids = footer_ids[1:]  # NOTE: the generated EOS is the footer's first token
        return _Segment(tuple(encode(injected)), (*encode(header), *entry.token_ids, *footer_ids))

    def _segment_text(self, dicts: list[dict[str, Any]], tools: list[Any] | None) -> str:
        """The template's text for ``dicts[-1]``, or its ChatML text (warning) when that fails."""
        if self.uses_template:
            text = self._template_diff(dicts, tools)
            if text is not None:
                return text
            logger.warning(
                "the chat template could not render message %d (role %r) as an extension of the "
                "messages before it; rendering that message in ChatML",
                len(dicts) - 1,
                dicts[-1]["role"],
            )
        return chatml_segment(dicts[-1]["role"], dicts[-1]["content"])

    def _split_injected(
        self, first: dict[str, Any], text: str, tools: list[Any] | None
    ) -> tuple[str, str]:
        """(injected, own) for a first message that is not a system message: its own text is what
        the template adds for it after a system message; the rest before it was injected."""
        if not self.uses_template:
            return "", text
        own = self._template_diff([_PROBE_SYSTEM, first], tools)
        if own and len(own) < len(text) and text.endswith(own):
            return text[: -len(own)], own
        return "", text

    def _generation_segment(self, entries: list[_Entry], tools: list[Any] | None) -> _Segment:
        text = CHATML_GENERATION_PROMPT
        if self.uses_template:
            dicts = [e.payload for e in entries]
            with_prompt = self._apply(dicts, True, tools)
            without = self._apply(dicts, False, tools) if dicts else ""
            if with_prompt is not None and without is not None and with_prompt.startswith(without):
                text = with_prompt[len(without) :]
            else:
                logger.warning("the template's generation prompt is no extension; using ChatML's")
        return _Segment((), tuple(self.tokenizer.encode(text)))

    def _template_diff(self, dicts: list[dict[str, Any]], tools: list[Any] | None) -> str | None:
        """template(dicts) minus template(dicts[:-1]); None if either raises or it is no
        extension of the shorter text."""
        before = self._apply(dicts[:-1], False, tools) if len(dicts) > 1 else ""
        after = self._apply(dicts, False, tools)
        if before is None or after is None or not after.startswith(before):
            return None
        return after[len(before) :]

    def _apply(
        self, dicts: list[dict[str, Any]], generation: bool, tools: list[Any] | None
    ) -> str | None:
        try:
            return self.tokenizer.apply_chat_template(
                dicts, add_generation_prompt=generation, tools=tools
            )
        except Exception as error:  # templates raise anything (jinja, RuntimeError, ValueError)
            logger.debug("chat template raised on %d messages: %s", len(dicts), error)
            return None

    def _cached(self, key: bytes, compute: Callable[[], _Segment]) -> _Segment:
        value = self._cache.get(key)  # a hit makes the entry the most recently used
        if value is None:
            value = compute()
            self._cache[key] = value  # beyond cache_size, the least recently used goes
        return value

    # -- probes (run once, at construction) --------------------------------------------------

    def _template_is_prefix_stable(self) -> bool:
        turns = [
            {"role": role, "content": content}
            for role, content in (("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))
        ]
        probes = [[_PROBE_SYSTEM, *turns, {"role": "assistant", "content": "Bye"}], turns]
        for probe in probes:
            texts = [self._apply(probe[:k], False, None) for k in range(1, len(probe) + 1)]
            texts.append(self._apply(probe, True, None))
            rendered = [t for t in texts if t is not None]
            if len(rendered) < len(texts) or any(
                not b.startswith(a) for a, b in zip(rendered, rendered[1:])
            ):
                logger.warning(
                    "the chat template is not prefix-stable (rendering more messages changes the "
                    "text of earlier ones); rendering every conversation in default ChatML instead"
                )
                return False
        return True

    def _template_shows_tool_content(self) -> bool:
        tool = {"role": "tool", "content": _PROBE_TOOL_CONTENT, "tool_call_id": "c1", "name": "t"}
        text = self._template_diff([_PROBE_SYSTEM, {"role": "user", "content": "Hi"}, tool], None)
        return text is not None and _PROBE_TOOL_CONTENT in text


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _chain(digest: bytes, text: str) -> bytes:
    return hashlib.blake2b(digest + text.encode(), digest_size=16).digest()
