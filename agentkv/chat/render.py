"""Render a conversation to token ids exactly as its chat template does, recording each message's token span.

::

    renderer = ChatRenderer(engine.tokenizer)
    prompt = renderer.render([Message.system("Be brief."), Message.user("hi")], tools=[schema])
    prompt.token_ids, prompt.spans[1].start, prompt.prefix_len, prompt.generation_prompt_len

A template that is not prefix-stable (probed once, with and without tools: ``chat/template.py``)
renders each conversation whole (``chat/render_whole.py``: Qwen3, Phi-3.5, Mistral Nemo, Gemma 2,
Llama 3.1 with tools). A prefix-stable one renders message by message, and its ids are built so
that rendering messages[:k] always gives a prefix of rendering messages[:k+1]:

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
- Tool calls without ``token_ids`` go to the template as ``tool_calls`` when it renders them in
  its own format, else render as the content plus the calls in the model's tool-call format
  (``tool_format.format_calls``, what ``tool_format.parse`` reads back; ``<tool_call>`` blocks
  for Hermes, the fallback). Call ids go through ``tool_format.call_id`` (Mistral's templates
  need nine letters and digits). A generated message with calls keeps them for the
  whole-conversation renderer too (``Entry.calls_payload``), for a template that refuses them as
  plain content (Mistral Nemo's role-alternation check).
- Tool results render as role "tool" when the template shows their content verbatim; when it
  raises, or rewrites the content (openvino-genai's template polyfill turns it into JSON in a
  user turn), they render as a user turn ``<tool_response>\\n…\\n</tool_response>``.
- Tools: the template's native ``tools=`` is used when it shows them (probed); else
  ``tools_text(tools)`` is appended to the leading system message (a new one if there is none).
  Tool schemas are never dropped: a conversation the template cannot render at all is rendered
  in ChatML with the tools text (a warning is logged).
- A system prompt the template merges into the first user turn (Gemma 3) ends where that turn's
  content starts: its span, and ``prefix_len``, cover all the text every conversation shares.
- A single message the template cannot render (it raises, or its rendering is not an extension
  of the shorter one) is rendered in ChatML, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from cachetools import LRUCache

from agentkv.chat.messages import Message
from agentkv.chat.prompt import Entry, MessageSpan, RenderedPrompt, ends_prefix
from agentkv.chat.render_whole import WholeConversation
from agentkv.chat.template import PROBE_SYSTEM, ChatTemplate
from agentkv.chat.tool_formats import HERMES, ToolCallFormat, detect_tool_format, markup_tokens
from agentkv.engine.base import Tokenizer
from agentkv.errors import UserError

logger = logging.getLogger(__name__)

CHATML_GENERATION_PROMPT = "<|im_start|>assistant\n"
_SENTINEL = "AGENTKV_GENERATED_CONTENT_7F3C"
__all__ = ["ChatRenderer", "MessageSpan", "RenderedPrompt", "chatml_segment", "default_tools_text"]


def default_tools_text(tools: Sequence[dict[str, Any]]) -> str:
    """An instruction, one JSON schema per line, and the ``<tool_call>`` format to call them
    (the Hermes format's instructions): ``default_tools_text([calculator.schema_for_prompt()])``."""
    return HERMES.instructions(tools)


def chatml_segment(role: str, content: str) -> str:
    """The default (fallback) ChatML text for one message."""
    return f"<|im_start|>{role}\n{content}<|im_end|>\n"


@dataclass(frozen=True)
class _Segment:
    synthetic: tuple[int, ...]
    """Ids of the injected text that belongs to no message (only ever at position 0)."""
    own: tuple[int, ...]
    """Ids of the message itself (or of the generation prompt)."""
    lead: tuple[int, ...] = ()
    """Ids at the start of the first message after a system prompt that belong to that system
    prompt: the text a template merging the system prompt into the first user turn puts before
    that turn's content."""


class ChatRenderer:
    """Renders messages with a tokenizer's chat template; see the module docstring for the rules."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        tools_text: Callable[[Sequence[dict[str, Any]]], str] | None = None,
        stop_token_ids: Iterable[int] = (),
        cache_size: int = 4096,
    ) -> None:
        """``stop_token_ids``: the ids that end a generated turn besides the tokenizer's EOS (the
        engine's ``eos_token_ids``): a template footer repeating the one a generated message
        ends in is not written twice."""
        self.tokenizer = tokenizer
        self.stop_ids = frozenset({tokenizer.eos_token_id, *stop_token_ids})
        self.template = ChatTemplate(tokenizer)
        self.tool_format: ToolCallFormat = detect_tool_format(self.template.source, markup_tokens(tokenizer.encode))
        """How this model writes tool calls (``chat/tool_formats.py``): what the grammar forces,
        the parser reads and, for a template that does not render calls itself, what they render
        as."""
        self.tools_text = tools_text or self.tool_format.instructions
        self._whole = WholeConversation(self.template, tokenizer.encode, stop_ids=self.stop_ids,
                                        cache_size=cache_size)
        self.reasoning_ids: tuple[int, int] | None = None
        """The ids of ``reasoning_tags`` when each is one token of the vocabulary (Qwen3's are):
        what the grammar forces and what a dropped thinking block is found by; else None."""
        self.reasoning_tags = (("<think>", "</think>")
                               if "<think>" in self.template.source and "</think>" in self.template.source else None)
        self._cache: LRUCache[bytes, _Segment] = LRUCache(maxsize=cache_size)
        self.native_tools = self.template.native_tools
        """True when the template shows the schemas passed as ``tools=`` (probed)."""
        self.native_tool_calls = self.template.native_tool_calls
        """True when assistants' tool calls go to the template as ``tool_calls`` (it renders them)."""
        self.native_tool_role = self.template.native_tool_role
        """True when tool results go through the template as role "tool"."""
        self.uses_template = self._template_renders_a_conversation()
        """False when the template cannot render even a probe conversation: ChatML is used."""
        self.whole_conversations = self.uses_template and not self.template.prefix_stable(tools=False)
        """True when conversations are rendered whole (the template is not prefix-stable)."""

    @property
    def reasoning_tags(self) -> tuple[str, str] | None:
        """The tags a reasoning model writes its thinking between (Qwen3: ``<think>``,
        ``</think>``), when its template handles them; None for other models. Setting them sets
        ``reasoning_ids`` too."""
        return self._reasoning_tags

    @reasoning_tags.setter
    def reasoning_tags(self, tags: tuple[str, str] | None) -> None:
        self._reasoning_tags = tags
        tag_ids = [self.tokenizer.encode(tag) for tag in tags or ()]
        self.reasoning_ids = (tag_ids[0][0], tag_ids[1][0]) if tag_ids and all(len(i) == 1 for i in tag_ids) else None
        self._whole.reasoning_ids = self.reasoning_ids

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[dict[str, Any]] = (),
        add_generation_prompt: bool = True,
    ) -> RenderedPrompt:
        """Token ids and spans for ``messages``: ``renderer.render([Message.user("hi")])``."""
        native = list(tools) if tools and self.native_tools and self.uses_template else None
        entries = self._entries(messages, tools, chatml=False)
        if entries and self.uses_template and not self.template.prefix_stable(tools=native is not None):
            prompt = self._whole.render(entries, tools=native, add_generation_prompt=add_generation_prompt)
            if prompt is not None:
                return prompt
            logger.warning("the chat template could not render this conversation (%d messages); "
                           "rendering it in ChatML, tools as text", len(entries))
            entries, native = self._entries(messages, tools, chatml=True), None
            return self._render_segments(entries, None, add_generation_prompt, use_template=False)
        return self._render_segments(entries, native, add_generation_prompt, use_template=self.uses_template)

    def _render_segments(self, entries: list[Entry], native: list[Any] | None, add_generation_prompt: bool,
                         *, use_template: bool) -> RenderedPrompt:
        digest = hashlib.blake2b(_json([native, use_template]).encode(), digest_size=16).digest()
        ids: list[int] = []
        spans: list[MessageSpan] = []
        prefix_len = 0
        for position, entry in enumerate(entries):
            digest = _chain(digest, _json([entry.payload, entry.token_ids]))
            segment = self._cached(digest, partial(self._segment, entries, position, native, use_template))
            ids += segment.synthetic
            if segment.synthetic:
                prefix_len = len(ids)
            if segment.lead:  # the system prompt's text at the start of the first user turn
                ids += segment.lead
                if spans and spans[-1].index == 0 and spans[-1].role == "system":
                    spans[-1] = MessageSpan(0, "system", spans[-1].start, len(ids))
                prefix_len = len(ids)
            start = len(ids)
            ids += segment.own
            if ends_prefix(entry):
                prefix_len = len(ids)
            if entry.index is not None:  # None: the system message created for the tools text
                spans.append(MessageSpan(entry.index, entry.role, start, len(ids)))
        generation: tuple[int, ...] = ()
        if add_generation_prompt:
            key = _chain(digest, "generation prompt")
            compute = partial(self._generation_segment, entries, native, use_template)
            generation = self._cached(key, compute).own
        return RenderedPrompt(tuple(ids) + generation, tuple(spans), prefix_len, len(generation))

    def message_tokens(self, message: Message, *, position: int) -> int:
        """Tokens of ``message``'s span at ``position`` (tools text not counted), for budgets:
        ``renderer.message_tokens(Message.user("hi"), position=3)``. Counted among the first
        neighbours the template accepts that give the message its usual place: a user turn after
        an answer (not the first user turn, which a merging template shares with the system
        prompt: that one is over-counted by its header), a system prompt before a user turn
        (which may hold its text)."""
        if position < 0:
            raise UserError(f"position must be >= 0, got {position}")
        system, user = Message.system(PROBE_SYSTEM["content"]), Message.user("Hi")
        answer = Message.assistant("Hello")
        places: list[tuple[list[Message], list[Message]]]
        if position == 0:
            places = [([], [user] if message.role == "system" else []), ([], [])]
        elif message.role == "assistant":  # NOTE: no system prompt first: Mistral's moves it around
            places = [([user], []), ([system, user], []), ([system], [])]
        else:
            places = [([user, answer], []), ([system, user, answer], []), ([system], []), ([system, user], [])]
        before, after = places[-1]
        for before, after in places:
            dicts = [self._payload(m, chatml=False) for m in (*before, message, *after)]
            if not self.uses_template or self.template.apply(dicts, generation=False) is not None:
                break
        prompt = self.render([*before, message, *after], add_generation_prompt=False)
        return len(prompt.spans[len(before)])

    # -- entries: messages as template dicts -------------------------------------------------

    def _entries(self, messages: Sequence[Message], tools: Sequence[dict[str, Any]], *,
                 chatml: bool) -> list[Entry]:
        entries = []
        for index, message in enumerate(messages):
            if not isinstance(message, Message):
                kind = type(message).__name__
                raise UserError(f"messages[{index}] is a {kind}; pass Message objects")
            payload = self._payload(message, chatml=chatml)
            token_ids = message.token_ids if message.role == "assistant" else None
            calls = None
            if token_ids is not None and message.tool_calls and self.native_tool_calls and not chatml:
                calls = {"role": "assistant", "content": message.content, "tool_calls": self._calls(message)}
            entries.append(Entry(payload, index, message.role, token_ids, calls))
        if tools and (chatml or not self.native_tools or not self.uses_template):
            text = self.tools_text(tools)
            if entries and entries[0].role == "system":
                first = entries[0]
                content = "\n\n".join(p for p in (first.payload["content"], text) if p)
                entries[0] = Entry({**first.payload, "content": content}, 0, "system", None)
            else:
                entries.insert(0, Entry({"role": "system", "content": text}, None, "system", None))
        return entries

    def _payload(self, message: Message, *, chatml: bool) -> dict[str, Any]:
        if message.role == "tool":
            if not self.native_tool_role or chatml:
                wrapped = f"<tool_response>\n{message.content}\n</tool_response>"
                return {"role": "user", "content": wrapped}
            result = {"role": "tool", "content": message.content}
            if message.tool_call_id is not None:
                result["tool_call_id"] = self.tool_format.call_id(message.tool_call_id)
            if message.name is not None:
                result["name"] = message.name
            return result
        if message.role != "assistant":
            return {"role": message.role, "content": message.content}
        payload: dict[str, Any] = {"role": "assistant", "content": message.content}
        if message.tool_calls and self.native_tool_calls and not chatml and message.token_ids is None:
            payload["tool_calls"] = self._calls(message)
        elif message.tool_calls:
            calls_text = self.tool_format.format_calls(message.tool_calls)
            payload["content"] = "\n".join(p for p in (message.content, calls_text) if p)
        if message.reasoning and message.token_ids is None and self.reasoning_tags and not chatml:
            if "reasoning_content" in self.template.source:  # Qwen3 reads it as a field
                payload["reasoning_content"] = message.reasoning
            else:
                opening, closing = self.reasoning_tags
                payload["content"] = f"{opening}\n{message.reasoning}\n{closing}\n\n{payload['content']}"
        return payload

    def _calls(self, message: Message) -> list[dict[str, Any]]:
        """``message``'s tool calls as the template's ``tool_calls`` dicts, ids in the format's shape."""
        return [{"id": self.tool_format.call_id(call.id), "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}} for call in message.tool_calls]

    # -- segments ----------------------------------------------------------------------------

    def _segment(self, entries: list[Entry], position: int, tools: list[Any] | None,
                 use_template: bool) -> _Segment:
        entry = entries[position]
        dicts = [e.payload for e in entries[: position + 1]]
        if entry.token_ids is not None:
            dicts[-1] = {k: v for k, v in dicts[-1].items() if k != "tool_calls"} | {"content": _SENTINEL}
        text = self._segment_text(dicts, tools, use_template)
        injected = lead = ""
        if position == 0 and entry.payload["role"] != "system" and use_template:
            injected, text = self._split_injected(dicts[0], text, tools)
        if position == 1 and entries[0].payload["role"] == "system" and use_template:
            lead = self._system_lead(entries[0].payload, tools)
            lead = lead if lead and text.startswith(lead) and len(text) > len(lead) else ""
            text = text[len(lead):]
        encode = self.tokenizer.encode
        lead_ids = tuple(encode(lead)) if lead else ()
        if entry.token_ids is None:
            return _Segment(tuple(encode(injected)), tuple(encode(text)), lead_ids)
        header, found, footer = text.partition(_SENTINEL)
        if not found:
            logger.warning("the chat template hid an assistant message's content; using ChatML")
            header, _, footer = chatml_segment("assistant", _SENTINEL).partition(_SENTINEL)
        footer_ids = encode(footer)
        generated = entry.token_ids
        if generated[-1:] and generated[-1] in self.stop_ids and footer_ids[:1] and footer_ids[0] in self.stop_ids:
            if footer_ids[0] == generated[-1]:
                footer_ids = footer_ids[1:]  # NOTE: the generated stop token is the footer's first token
            else:
                generated = generated[:-1]  # NOTE: Llama's <|eom_id|> gives way to the footer's <|eot_id|>
        own = (*encode(header), *generated, *footer_ids)
        return _Segment(tuple(encode(injected)), own, lead_ids)

    def _system_lead(self, system: dict[str, Any], tools: list[Any] | None) -> str:
        """The text a template that merges the system prompt into the first user turn puts
        before that turn's content, after the system message's own text ("" when the system
        message renders its content itself, as ChatML does)."""
        alone = self.template.apply([system], generation=False, tools=tools)
        content = str(system.get("content") or "")
        if alone is None or not content or content in alone:
            return ""
        head = self.template.before_first_user_content(system, tools)
        return head[len(alone):] if head is not None and head.startswith(alone) else ""

    def _segment_text(self, dicts: list[dict[str, Any]], tools: list[Any] | None, use_template: bool) -> str:
        """The template's text for ``dicts[-1]``, or its ChatML text (warning) when that fails."""
        if use_template:
            text = self.template.diff(dicts, tools)
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
        own = self.template.diff([PROBE_SYSTEM, first], tools)
        if own and len(own) < len(text) and text.endswith(own):
            return text[: -len(own)], own
        return "", text

    def _generation_segment(self, entries: list[Entry], tools: list[Any] | None, use_template: bool) -> _Segment:
        text = CHATML_GENERATION_PROMPT
        if use_template:
            dicts = [e.payload for e in entries]
            with_prompt = self.template.apply(dicts, generation=True, tools=tools)
            without = self.template.apply(dicts, generation=False, tools=tools) if dicts else ""
            if with_prompt is not None and without is not None and with_prompt.startswith(without):
                text = with_prompt[len(without) :]
            else:
                logger.warning("the template's generation prompt is no extension; using ChatML's")
        return _Segment((), tuple(self.tokenizer.encode(text)))

    def _cached(self, key: bytes, compute: Callable[[], _Segment]) -> _Segment:
        value = self._cache.get(key)  # a hit makes the entry the most recently used
        if value is None:
            value = compute()
            self._cache[key] = value  # beyond cache_size, the least recently used goes
        return value

    # -- probes (run once, at construction) --------------------------------------------------

    def _template_renders_a_conversation(self) -> bool:
        turns = [{"role": role, "content": content}
                 for role, content in (("user", "Hi"), ("assistant", "Hello"), ("user", "Bye"))]
        for probe in ([PROBE_SYSTEM, *turns], turns):
            if self.template.apply(probe, generation=True) is not None:
                return True
        logger.warning("the chat template cannot render a plain conversation; rendering every "
                       "conversation in default ChatML instead")
        return False


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _chain(digest: bytes, text: str) -> bytes:
    return hashlib.blake2b(digest + text.encode(), digest_size=16).digest()
