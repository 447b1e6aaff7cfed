"""Render a whole conversation with one template call, for templates that are not prefix-stable.

Qwen3 (an empty ``<think></think>`` on the last assistant turn only), Phi-3.5 (``<|endoftext|>``
after a last assistant turn), Mistral Nemo (the system prompt and tools inside the *last* user
turn), Gemma 2 (the system prompt merged into the first user turn), Llama 3.1 with tools (the
schemas inside the first user turn) change earlier text when a message is added, by design. Their
conversations are rendered exactly as the template renders them, every time::

    whole = WholeConversation(ChatTemplate(tok), encode, stop_ids=frozenset({tok.eos_token_id}))
    prompt = whole.render(entries, tools=None, add_generation_prompt=True)   # None: the template raised

- The text is ``template(messages, add_generation_prompt=True)``; the generation prompt is what it
  adds to ``template(messages)``. The history (``add_generation_prompt=False``) is the text a next
  turn reads: the same text without the generation prompt (Phi-3.5's ``<|endoftext|>`` after a
  last assistant turn is left out: no next turn reads it), and, when the last message is an
  assistant's, cut from a rendering with a user turn after it (Qwen3 adds an empty ``<think>``
  block to the last assistant turn only).
- Assistant messages with generated ``token_ids`` render verbatim: the template sees a marker as
  their content, and the marker is replaced by the ids (a stop token the footer repeats is not
  written twice). When the template refuses that (Mistral Nemo's role-alternation check skips
  calling messages: a call shown as plain content, then an answer, breaks the alternation), a
  generated message with tool calls goes to it as those calls, and the text its ids decode to,
  found in the rendering, is replaced by the ids: both ways give the same text.
- Message boundaries: message i ends where the template's rendering of messages[:i+1] stops
  agreeing with the whole text (extended over the message's own content and what follows it in
  both, when the template renders a last message differently, as Qwen3 does). A system prompt
  the template merges into the first user turn (Gemma, Llama 3.1's tools) ends where that turn's
  content starts, so its span holds everything every conversation of the agent shares.
  Boundaries only say which message a token belongs to (budgets, cache-break attribution, the
  window policies' plans); the KV's correctness never rests on them: a session keeps only the
  longest common prefix of its KV and the prompt.
- Each span's text is tokenised on its own (cached by text), as the prefix-stable renderer does.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from cachetools import LRUCache

from agentkv.chat.generated_markers import GeneratedMarkers
from agentkv.chat.prompt import Entry, MessageSpan, RenderedPrompt, ends_prefix
from agentkv.chat.template import PROBE_USER_CONTENT, ChatTemplate, common_prefix

MARKER = "AGENTKV_GENERATED_CONTENT_7F3C_"
"""Stands for a generated message's content; ``MARKER<n>_`` for the n-th one, ``MARKER<n>w_``
for the whole of a reasoning model's message (thinking included)."""
_MARKERS = re.compile(re.escape(MARKER) + r"\d+w?_")
_REASONING = "AGENTKV_REASONING_7F3C_"
_CUT_WINDOW = 64
"""Characters on each side of a boundary whose ids must not change when it is cut there."""
_PROBE_INDEX = -1
"""The index of the user turn a history is rendered before (no message of the caller's)."""


class WholeConversation:
    """Renders whole conversations exactly; see the module docstring for the rules."""

    def __init__(self, template: ChatTemplate, encode: Callable[[str], Sequence[int]], *,
                 stop_ids: frozenset[int], reasoning_ids: tuple[int, int] | None = None,
                 cache_size: int = 4096) -> None:
        """``reasoning_ids``: the ids of a reasoning model's ``<think>`` and ``</think>``, when its
        template decides where earlier thinking is shown."""
        self.template = template
        self._encode_text = encode
        self.stop_ids = stop_ids
        self.reasoning_ids = reasoning_ids
        self._texts: LRUCache[bytes, str | None] = LRUCache(maxsize=cache_size)
        self._ids: LRUCache[str, tuple[int, ...]] = LRUCache(maxsize=cache_size)
        self._prompts: LRUCache[bytes, RenderedPrompt | None] = LRUCache(maxsize=64)

    def render(self, entries: Sequence[Entry], *, tools: list[Any] | None,
               add_generation_prompt: bool) -> RenderedPrompt | None:
        """The conversation's ids and spans, or None when the template cannot render it whole
        (it raises, or hides a generated message): ``whole.render(entries, tools=None,
        add_generation_prompt=True)``."""
        if not add_generation_prompt and entries and entries[-1].role == "assistant":
            return self._history(entries, tools)
        key = _digest([tools, [(e.payload, e.token_ids, e.index, e.role, e.calls_payload) for e in entries],
                       add_generation_prompt])
        if key not in self._prompts:
            self._prompts[key] = next(filter(None, (
                self._render(entries, tools, add_generation_prompt, split_thinking=split, template_calls=calls)
                for split, calls in self._attempts(entries))), None)
        return self._prompts[key]

    def _attempts(self, entries: Sequence[Entry]) -> list[tuple[bool, bool]]:
        """The ways to try, in order (``split_thinking``, ``template_calls``): a reasoning model's
        messages with their thinking apart, then whole; then, when a generated message holds tool
        calls the template renders itself, the same with those messages shown to the template as
        calls (Mistral's template skips calling messages in its role-alternation check, so a
        history with a calling message shown as text breaks the alternation and it raises)."""
        splits = [True, False] if self.reasoning_ids is not None else [True]
        calls = [False, True] if any(e.calls_payload is not None for e in entries) else [False]
        return [(split, call) for call in calls for split in splits]

    def _history(self, entries: Sequence[Entry], tools: list[Any] | None) -> RenderedPrompt | None:
        """A history ending in an assistant message, as the next user turn will read it: Qwen3's
        template adds an empty ``<think>`` block to an assistant message only while it is the last
        one, so the history is cut from a rendering with one more user turn after it."""
        probe = Entry({"role": "user", "content": PROBE_USER_CONTENT}, _PROBE_INDEX, "user", None)
        prompt = self.render([*entries, probe], tools=tools, add_generation_prompt=True)
        if prompt is None:
            return None
        spans = tuple(span for span in prompt.spans if span.index != _PROBE_INDEX)
        end = spans[-1].end if spans else prompt.prefix_len
        return RenderedPrompt(prompt.token_ids[:end], spans, min(prompt.prefix_len, end), 0)

    def _render(self, entries: Sequence[Entry], tools: list[Any] | None, add_generation_prompt: bool, *,
                split_thinking: bool, template_calls: bool = False) -> RenderedPrompt | None:
        dicts, generated_ids = self._dicts(entries, split_thinking, template_calls)
        verbatim = generated_ids.ids
        full = generated_ids.substitute(self.template.apply(dicts, generation=True, tools=tools))
        body = generated_ids.substitute(self.template.apply(dicts, generation=False, tools=tools))
        if full is None or body is None or _REASONING in full or not all(
                any(marker in full for marker in markers) for markers in generated_ids.markers):
            return None  # NOTE: a template hid a generated message, or showed thinking its own way
        markers = [(m.start(), m.end()) for m in _MARKERS.finditer(full)]
        last_marker = max((end for _, end in markers), default=0)
        history_end = self._token_cut(full, max(common_prefix(full, body), last_marker), last_marker)
        text = full[:history_end]
        bounds = self._bounds(dicts, text, tools, markers, generated_ids)
        ids: list[int] = []
        spans: list[MessageSpan] = []
        prefix_len = start = 0
        generated: tuple[int, ...] = ()
        for entry, end in zip(entries, bounds):
            first = len(ids)
            piece, generated = self._encode_piece(text[start:end], verbatim, generated)
            ids += piece
            start = end
            if ends_prefix(entry):
                prefix_len = len(ids)
            if entry.index is not None:  # None: the system message created for the tools text
                spans.append(MessageSpan(entry.index, entry.role, first, len(ids)))
        generation = tuple(self._after(generated, self._encode(full[history_end:]))) if add_generation_prompt else ()
        return RenderedPrompt(tuple(ids) + generation, tuple(spans), prefix_len, len(generation))

    # -- where each message ends -----------------------------------------------------------------

    def _bounds(self, dicts: list[dict[str, Any]], text: str, tools: list[Any] | None,
                markers: list[tuple[int, int]], generated: GeneratedMarkers) -> list[int]:
        """The end (in characters of ``text``) of each message's span."""
        bounds: list[int] = []
        previous = 0
        digest = _digest(tools)
        for i, payload in enumerate(dicts):
            digest = _chain(digest, [payload, generated.written_at(i)])
            alone = self._text(digest, dicts[: i + 1], tools, generated)
            end = max(previous, common_prefix(text, alone)) if alone is not None else previous
            for content in generated.contents(i, payload):
                end = max(end, _content_end(text, alone, content, previous, end))
            if i == 0 and payload["role"] == "system" and _merged(payload, text, alone, end):
                end = max(end, self._system_lead_end(payload, text, tools))
            end = self._token_cut(text, min(end, len(text)), previous)
            bounds.append(_outside_markers(end, markers))
            previous = bounds[-1]
        if bounds:
            bounds[-1] = len(text)
        return bounds

    def _system_lead_end(self, system: dict[str, Any], text: str, tools: list[Any] | None) -> int:
        """Where a system prompt the template merges into the first user turn ends: where that
        turn's content starts (0 when ``text`` does not start that way)."""
        head = self.template.before_first_user_content(system, tools)
        return len(head) if head is not None and text.startswith(head) else 0

    def _text(self, key: bytes, dicts: list[dict[str, Any]], tools: list[Any] | None,
              generated: GeneratedMarkers | None = None) -> str | None:
        if key not in self._texts:
            text = self.template.apply(dicts, generation=False, tools=tools)
            self._texts[key] = generated.substitute(text) if generated is not None else text
        return self._texts[key]

    def _token_cut(self, text: str, cut: int, floor: int) -> int:
        """``cut``, or the start of its line when cutting there would split a token (two texts
        that agree up to ``"<|"`` of two special tokens): cutting must not change the ids."""
        if cut <= floor or cut >= len(text):
            return cut
        line = max(text.rfind("\n", floor, cut) + 1, floor)
        if line == cut:
            return cut
        end = text.find("\n", cut)
        end = len(text) if end < 0 else end + 1
        end = min(end, cut + _CUT_WINDOW)  # NOTE: Mistral's prompts are one long line
        line = max(line, cut - _CUT_WINDOW)
        if self._encode(text[line:cut]) + self._encode(text[cut:end]) == self._encode(text[line:end]):
            return cut
        return line

    # -- generated messages -----------------------------------------------------------------------

    def _dicts(self, entries: Sequence[Entry], split_thinking: bool,
               template_calls: bool = False) -> tuple[list[dict[str, Any]], GeneratedMarkers]:
        """The template's dicts, a marker standing for each generated message's content; with
        ``split_thinking``, a reasoning model's message shows the template its thinking apart
        (``<think>`` … ``</think>``), so the template decides whether it stays: where it shows it,
        the whole message's ids go; where it drops it, the answer's ids only. With
        ``template_calls``, a generated message with tool calls goes to the template as those
        calls (``Entry.calls_payload``), and the text its ids decode to, found in the rendering,
        gives way to its marker: the template must render the calls as the model wrote them."""
        dicts: list[dict[str, Any]] = []
        ids: dict[str, tuple[int, ...]] = {}
        shown: dict[str, str] = {}
        markers: list[tuple[str, ...]] = []
        written: list[tuple[int, str, str, int]] = []
        for entry in entries:
            payload = entry.payload
            if entry.token_ids is not None and template_calls and entry.calls_payload is not None:
                marker = f"{MARKER}{len(markers)}_"
                ids[marker] = entry.token_ids
                markers.append((marker,))
                text = self._written_text(entry.token_ids)
                written.append((len(dicts), text, marker, self._occurrences_before(dicts, text)))
                payload = entry.calls_payload
            elif entry.token_ids is not None:
                n = len(markers)
                marker = f"{MARKER}{n}_"
                payload = {k: v for k, v in payload.items() if k != "tool_calls"} | {"content": marker}
                answer = self._answer_start(entry.token_ids) if split_thinking else None
                if answer is None:
                    ids[marker] = entry.token_ids
                    markers.append((marker,))
                else:
                    whole, thinking = f"{MARKER}{n}w_", f"<think>\n{_REASONING}{n}_\n</think>\n\n{marker}"
                    ids[marker], ids[whole] = entry.token_ids[answer:], entry.token_ids
                    shown[thinking] = whole
                    payload["content"] = thinking
                    markers.append((marker, whole))
            dicts.append(payload)
        return dicts, GeneratedMarkers(ids, shown, tuple(markers), tuple(written))

    def _occurrences_before(self, dicts: list[dict[str, Any]], text: str) -> int:
        """How often ``text`` occurs in the rendering of ``dicts`` (the messages before a calling
        message; no tools: a schema never holds a call's text), 0 when the template refuses it."""
        before = self.template.apply(dicts, generation=False, tools=None) if dicts else None
        return before.count(text) if before else 0

    def _written_text(self, token_ids: tuple[int, ...]) -> str:
        """The text of generated ids without the stop token they end on (the template's footer
        writes that)."""
        end = len(token_ids) - 1 if token_ids[-1:] and token_ids[-1] in self.stop_ids else len(token_ids)
        return self.template.tokenizer.decode(list(token_ids[:end]))

    def _answer_start(self, token_ids: tuple[int, ...]) -> int | None:
        """Where the answer starts in a reasoning model's message that opens with a closed
        ``<think>`` block (after the newlines that follow ``</think>``); None for any other."""
        if self.reasoning_ids is None or token_ids[:1] != (self.reasoning_ids[0],):
            return None
        close = self.reasoning_ids[1]
        if close not in token_ids:
            return None
        answer = token_ids.index(close) + 1
        decode = self.template.tokenizer.decode
        while answer < len(token_ids) - 1 and not decode([token_ids[answer]]).strip():
            answer += 1
        return answer if answer < len(token_ids) else None

    # -- tokens ---------------------------------------------------------------------------------

    def _encode(self, text: str) -> tuple[int, ...]:
        ids = self._ids.get(text)
        if ids is None:
            ids = self._ids[text] = tuple(self._encode_text(text)) if text else ()
        return ids

    def _encode_piece(self, text: str, verbatim: dict[str, tuple[int, ...]],
                      generated: tuple[int, ...]) -> tuple[list[int], tuple[int, ...]]:
        """Ids of one span's text, generated messages' markers replaced by their ids; the text
        after a generated message (``generated``: the one just before this piece) does not
        repeat the stop token it already ends in. Also returns the generated ids this piece
        ends with (empty unless it ends with a marker)."""
        ids: list[int] = []
        position = 0
        for match in _MARKERS.finditer(text):
            ids += self._after(generated, self._encode(text[position: match.start()]))
            following = _MARKERS.search(text, match.end())
            generated = self._generated_ids(verbatim[match.group()],
                                            text[match.end(): following.start() if following else len(text)])
            ids += generated
            position = match.end()
        if position == len(text):
            return ids, generated
        return ids + self._after(generated, self._encode(text[position:])), ()

    def _after(self, generated: tuple[int, ...], footer: tuple[int, ...]) -> list[int]:
        if generated[-1:] and generated[-1] in self.stop_ids and footer[:1] == generated[-1:]:
            return list(footer[1:])  # NOTE: the generated stop token is the footer's first token
        return list(footer)

    def _generated_ids(self, generated: tuple[int, ...], text_after: str) -> tuple[int, ...]:
        """A generated message's ids as rendered: a stop token the model ended on (Llama's
        ``<|eom_id|>``) gives way to another one the template's footer starts with (its
        ``<|eot_id|>``); the stop token is generated, never read, so the KV holds neither."""
        footer = self._encode(text_after)
        if generated[-1:] and generated[-1] in self.stop_ids and footer[:1] and footer[0] in self.stop_ids \
                and footer[0] != generated[-1]:
            return generated[:-1]
        return generated


def _merged(system: dict[str, Any], text: str, alone: str | None, end: int) -> bool:
    """The template does not keep the system prompt a turn of its own in ``text``: its content
    is missing from the span so far, or is not followed there by what follows it when the system
    message is rendered alone (its closing markup). Phi-3.5's end-of-text after a lone system turn
    does not count: the closing ``<|end|>`` is shared."""
    content = str(system.get("content") or "")
    if not content:
        return False
    found = text.find(content)
    own = alone.rfind(content) if alone is not None else -1
    if found < 0 or own < 0 or found + len(content) > end:
        return True
    return common_prefix(text[found + len(content):], alone[own + len(content):]) == 0  # type: ignore[index]


def _content_end(text: str, alone: str | None, content: str, previous: int, end: int) -> int:
    """Where the message's own ``content`` ends in ``text`` plus what follows it there as it
    follows it in ``alone`` (its rendering as the last message); 0 when that cannot be told."""
    if alone is None:
        return 0
    found, own = text.find(content, previous), alone.rfind(content)
    if found < 0 or own < 0:
        return 0
    if found > end and text[end:found] != alone[own - (found - end): own]:
        return 0  # the content is somewhere later (a system prompt the template moved)
    after = found + len(content)
    return after + common_prefix(text[after:], alone[own + len(content):])


def _outside_markers(position: int, markers: list[tuple[int, int]]) -> int:
    """``position``, moved to the end of a marker it falls inside."""
    for start, end in markers:
        if start < position < end:
            return end
    return position


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, default=str)


def _digest(value: Any) -> bytes:
    return hashlib.blake2b(_json(value).encode(), digest_size=16).digest()


def _chain(digest: bytes, value: Any) -> bytes:
    return hashlib.blake2b(digest + _json(value).encode(), digest_size=16).digest()
