"""Tool-call formats whose calls are JSON objects after a marker: Llama 3.1's bare
``{"name": …, "parameters": …}``, Mistral's ``[TOOL_CALLS][…]`` (9-character ids) and Phi-4-mini's
``<|tool_call|>[…]<|/tool_call|>``; one ``JsonCallFormat`` describes each::

    MISTRAL.format_calls([ToolCall(id="a1b2c3d4e", name="clock")])
    # '[TOOL_CALLS][{"name": "clock", "arguments": {}, "id": "a1b2c3d4e"}]'
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from agentkv.chat.grammar_schema import bounded_schema
from agentkv.chat.messages import ToolCall
from agentkv.chat.stream_filter import cut_tag_at_line_start
from agentkv.chat.tool_format import ToolCallFormat
from agentkv.chat.toolcalls import (
    JSON_LAYOUT,
    ParsedOutput,
    answer_rule,
    call_key,
    chosen_tools,
    lark_literal,
)

_DECODER = json.JSONDecoder()
_ID_CHARS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_REGEX_META = set("\\.+*?()|[]{}^$/")


@dataclass(frozen=True, repr=False)
class JsonCallFormat(ToolCallFormat):
    """Calls as JSON objects ``{"name": …, <arguments_key>: {…}[, "id": …]}`` after ``open_tag``
    (a list of them when ``as_list``), then ``close_tag``: ``JsonCallFormat("x", "<c>", "</c>")``."""

    name: str
    open_tag: str
    """The text that starts the calls; with ``open_in_json`` it is the start of the JSON itself."""
    close_tag: str = ""
    """The text after the calls ("" when the turn's end closes them)."""
    arguments_key: str = "arguments"
    as_list: bool = True
    """The calls are one JSON array (else one bare object per call, separated by newlines)."""
    single_call: bool = False
    """At most one call per answer (the family's template renders no more)."""
    open_in_json: bool = False
    id_length: int = 0
    """> 0: each call carries an ``"id"`` of this many letters and digits, written by the model."""
    lead_in: str = ""
    """Text the model may write before ``open_tag`` that is markup, not content (``<|python_tag|>``)."""
    special_ids: tuple[tuple[str, int], ...] = ()
    """Control tokens of the model's vocabulary the markup uses (text, id): the grammar forces
    the token itself, as the template's text tokenises, never its spelling in ordinary tokens."""
    prompt: str = "To call tools, answer with exactly this, and nothing else:"

    def with_special_ids(self, vocabulary: dict[str, int]) -> JsonCallFormat:
        """This format knowing the ids its markup has in ``vocabulary`` (token → id):
        ``MISTRAL.with_special_ids({"[TOOL_CALLS]": 9})``."""
        found = tuple((tag, vocabulary[tag]) for tag in (self.open_tag, self.close_tag) if tag in vocabulary)
        return replace(self, special_ids=found)

    # -- writing -----------------------------------------------------------------------------

    def format_calls(self, calls: Sequence[ToolCall]) -> str:
        """``LLAMA3_JSON.format_calls([ToolCall(name="clock")])`` → ``{"name": "clock", "parameters": {}}``."""
        objects = [self._call_json(call) for call in calls]
        body = "[" + ", ".join(objects) + "]" if self.as_list else "\n".join(objects)
        return ("" if self.open_in_json else self.open_tag) + body + self.close_tag

    def _call_json(self, call: ToolCall) -> str:
        payload: dict[str, Any] = {"name": call.name, self.arguments_key: call.arguments}
        if self.id_length:
            payload["id"] = self.call_id(call.id)
        return json.dumps(payload, ensure_ascii=False)

    def call_id(self, call_id: str) -> str:
        """``call_id`` when it already has the format's shape, else a stable one derived from it
        (Mistral: 9 letters and digits): ``MISTRAL.call_id("call_0123abcd")``."""
        if not self.id_length or re.fullmatch(f"[A-Za-z0-9]{{{self.id_length}}}", call_id):
            return call_id
        number = int.from_bytes(hashlib.blake2b(call_id.encode(), digest_size=16).digest(), "big")
        chars = []
        for _ in range(self.id_length):
            number, digit = divmod(number, len(_ID_CHARS))
            chars.append(_ID_CHARS[digit])
        return "".join(chars)

    def instructions(self, tools: Sequence[dict[str, Any]]) -> str:
        """``LLAMA3_JSON.instructions([calculator.schema_for_prompt()])``."""
        example = self.format_calls([ToolCall(name="<tool name>", arguments={"<argument>": "<value>"})])
        return "\n".join([
            "You can call these tools (one JSON schema per line):",
            *(json.dumps(tool, ensure_ascii=False) for tool in tools),
            self.prompt,
            example,
        ])

    # -- reading -----------------------------------------------------------------------------

    def parse(self, text: str) -> ParsedOutput:
        """``MISTRAL.parse('[TOOL_CALLS][{"name": "clock", "arguments": {}, "id": "a1b2c3d4e"}]')``."""
        start = text.find(self.open_tag)
        if start < 0:
            cut = cut_tag_at_line_start(text, self.open_tag)
            if cut:
                error = f"tool call 1: cut off in its opening {text[-cut:]!r}; {self._fix()}"
                return ParsedOutput(text[:-cut].strip(), errors=(error,), truncated=True)
            return ParsedOutput(text.strip())
        before = text[:start]
        if self.lead_in and before.rstrip().endswith(self.lead_in):
            before = before.rstrip()[: -len(self.lead_in)]
        body = start if self.open_in_json else start + len(self.open_tag)
        payloads, end, problem, cut_off = self._read_calls(text, body)
        calls: dict[str, ToolCall] = {}
        errors: list[str] = []
        repeats = 0
        for index, payload in enumerate(payloads, 1):
            call = self._call_from(payload, index)
            if isinstance(call, str):
                errors.append(call)
            elif (key := call_key(call)) in calls:
                repeats += 1
            else:
                if any(call.id == other.id for other in calls.values()):
                    # NOTE: its results need an id of their own
                    call = ToolCall(name=call.name, arguments=call.arguments)
                calls[key] = call
        if problem is not None:
            errors.append(problem)
        content = "\n".join(piece.strip() for piece in (before, text[end:]) if piece.strip())
        return ParsedOutput(content, tuple(calls.values()), tuple(errors), cut_off, repeats)

    def _read_calls(self, text: str, position: int) -> tuple[list[Any], int, str | None, bool]:
        """(decoded call payloads, where the markup ends, an error text or None, whether the
        text ends inside the markup)."""
        payloads: list[Any] = []
        while True:
            position = _skip_space(text, position)
            try:
                value, position = _DECODER.raw_decode(text, position)
            except json.JSONDecodeError as error:
                if _unclosed(text[position:]):
                    return payloads, len(text), f"tool call {len(payloads) + 1}: cut off; {self._fix()}", True
                where = (f"tool call {len(payloads) + 1}: invalid JSON "
                         f"({error.msg} at line {error.lineno} column {error.colno})")
                return payloads, len(text), f"{where}; {self._fix()}", False
            if not self.as_list:
                payloads.append(value)
                following = _skip_space(text, position)
                if text.startswith(self.open_tag, following):
                    position = following + (0 if self.open_in_json else len(self.open_tag))
                    continue
            elif isinstance(value, list):
                payloads.extend(value)
            else:
                return payloads, len(text), f"tool call 1: expected a JSON list of calls; {self._fix()}", False
            break
        if self.close_tag:
            after = _skip_space(text, position)
            if text.startswith(self.close_tag, after):
                return payloads, after + len(self.close_tag), None, False
            if self.close_tag.startswith(text[after:]):  # nothing, or the start of the close
                return payloads, len(text), f"tool calls: cut off before {self.close_tag}; {self._fix()}", True
            return payloads, position, f"tool calls: {self.close_tag} missing after the calls; {self._fix()}", False
        return payloads, position, None, False

    def _call_from(self, payload: Any, index: int) -> ToolCall | str:
        """The call one decoded object describes, or an error text naming it and the fix."""
        where, key = f"tool call {index}", self.arguments_key
        if not isinstance(payload, dict):
            return f"{where}: expected a JSON object, got {type(payload).__name__}; {self._fix()}"
        name = payload.get("name")
        if not isinstance(name, str) or not name.strip():
            return f'{where}: "name" is missing or not a non-empty string; {self._fix()}'
        arguments = payload.get(key, {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                return f'{where}: "{key}" of {name!r} is a string that is not JSON; {self._fix()}'
        if not isinstance(arguments, dict):
            return f'{where}: "{key}" of {name!r} must be a JSON object; {self._fix()}'
        call_id = payload.get("id")
        if self.id_length and isinstance(call_id, str) and call_id:
            return ToolCall(id=call_id, name=name.strip(), arguments=arguments)
        return ToolCall(name=name.strip(), arguments=arguments)

    def _fix(self) -> str:
        example = self.format_calls([ToolCall(id="a" * max(self.id_length, 1), name="<tool>")])
        return "write exactly " + example.replace('{}', '{...}')

    # -- constraining ------------------------------------------------------------------------

    def grammar(
        self,
        tools: Sequence[dict[str, Any]],
        tool_choice: str,
        *,
        max_string_length: int = 200,
        max_items: int = 16,
        parallel: bool = True,
        max_calls: int = 4,
        answer_schema: dict[str, Any] | None = None,
    ) -> str:
        """``MISTRAL.grammar([calculator.schema_for_prompt()], "required")``."""
        if max_calls < 1:
            raise ValueError(f"max_calls must be >= 1, got {max_calls}")
        chosen = chosen_tools(tools, tool_choice)
        count = 1 if self.single_call or not parallel else max_calls
        answer = "answer" if answer_schema is not None else "TEXT"
        open_part = "" if self.open_in_json else self._lark_text(self.open_tag) + " "
        close_part = " " + self._lark_text(self.close_tag) if self.close_tag else ""
        more = " more_1?" if count > 1 else ""
        body = f'"[" call{more} "]"' if self.as_list else f"call{more}"
        separator = lark_literal(", " if self.as_list else "\n")
        lines = [
            f"start: tool_calls | {answer}" if tool_choice == "auto" else "start: tool_calls",
            f"tool_calls: {open_part}{body}{close_part}",
            *(f"more_{k}: {separator} call{f' more_{k + 1}?' if k + 1 < count else ''}" for k in range(1, count)),
            "call: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
        ]
        id_head, id_tail = lark_literal(', "id": "'), lark_literal('"}')
        tail = f"{id_head} CALL_ID {id_tail}" if self.id_length else '"}"'
        for i, (name, parameters) in enumerate(chosen):
            head = lark_literal('{"name": ' + json.dumps(name) + ", " + json.dumps(self.arguments_key) + ": ")
            schema = bounded_schema(parameters, max_string_length=max_string_length, max_items=max_items)
            schema["x-guidance"] = {**schema.get("x-guidance", {}), **JSON_LAYOUT}
            lines.append(f"call_{i}: {head} arguments_{i} {tail}")
            lines.append(f"arguments_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
        if self.id_length:
            lines.append(f"CALL_ID: /[A-Za-z0-9]{{{self.id_length}}}/")
        if tool_choice == "auto" and answer_schema is not None:
            lines.append(answer_rule(answer_schema))
        elif tool_choice == "auto":
            # NOTE: plain text never holds the opening (nor, for Llama, its lead-in), so an answer
            # is prose or calls, never prose with a call in its middle.
            banned = "|".join(_regex_literal(tag) for tag in (self.open_tag, self.lead_in) if tag)
            lines.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*)(?:{banned})(?s:.*)/")
        return "\n".join(lines) + "\n"

    def _lark_text(self, text: str) -> str:
        """Lark for ``text``: its control token by id when the vocabulary has it, else the literal."""
        ids = dict(self.special_ids)
        return f"<[{ids[text]}]>" if text in ids else lark_literal(text)


def _skip_space(text: str, position: int) -> int:
    return len(text) - len(text[position:].lstrip())


def _regex_literal(text: str) -> str:
    """``text`` as a regex matching it literally (inside Lark's ``/…/``)."""
    return "".join("\\" + char if char in _REGEX_META else char for char in text)


def _unclosed(text: str) -> bool:
    """True when ``text`` (JSON that failed to decode) ends inside a string or an open bracket,
    i.e. was cut off rather than malformed."""
    depth, in_string, escaped = 0, False, False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
            if depth < 0:
                return False
    return in_string or depth > 0


LLAMA3_JSON = JsonCallFormat(
    "llama3_json", open_tag='{"name": ', arguments_key="parameters", as_list=False, single_call=True,
    open_in_json=True, lead_in="<|python_tag|>",
    prompt='To call a function, respond with only JSON in the format {"name": function name, '
    '"parameters": dictionary of argument name and its value}, for example:',
)
"""Llama 3.1 / 3.2: one bare JSON call per answer, as their templates render (they raise on more)."""
MISTRAL = JsonCallFormat("mistral", open_tag="[TOOL_CALLS]", id_length=9)
"""Mistral (Nemo, 7B v0.3): ``[TOOL_CALLS][{…, "id": "<9 letters/digits>"}, …]``."""
PHI4_MINI = JsonCallFormat("phi4_mini", open_tag="<|tool_call|>", close_tag="<|/tool_call|>")
"""Phi-4-mini: ``<|tool_call|>[{"name": …, "arguments": …}]<|/tool_call|>``."""
