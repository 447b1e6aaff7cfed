"""The ``<tool_call>`` text format for models whose chat template has no tool support.

The model writes zero or more blocks ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``;
this module formats them, parses them back (bad blocks become error texts for the model, never
exceptions), and writes the llguidance grammar that forces the model to produce them::

    text = format_tool_calls([ToolCall(name="calculator", arguments={"expression": "2+2"})])
    parsed = parse_tool_calls(text)        # parsed.tool_calls[0].name == "calculator"
    grammar = tool_call_grammar([calculator.schema_for_prompt()], "required")
    constraint = factory(grammar)          # engine/decode/constraints.py: ConstraintFactory
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agentkv.chat.grammar_schema import bounded_schema
from agentkv.chat.messages import ToolCall
from agentkv.chat.stream_filter import cut_tag_at_line_start

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOL_NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
"""Names a tool may have: what the tool-call grammar and parser carry (letters, digits, '_',
'-', '.'), so clients' namespaced names such as ``math.factorial`` work as they are."""
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance JSON options: exactly ``json.dumps``'s default layout, so the model cannot pad."""
_DECODER = json.JSONDecoder()
_FIX = (
    f'write exactly {{"name": "<tool>", "arguments": {{...}}}} between {TOOL_CALL_OPEN} '
    f"and {TOOL_CALL_CLOSE}"
)
_NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}

@dataclass(frozen=True)
class ParsedOutput:
    """A model's output split into prose and tool calls."""

    content: str
    """The text outside the tool-call blocks, stripped; never holds markup, not even a cut
    opening tag."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The well-formed calls, in order, each distinct call once."""
    errors: tuple[str, ...] = ()
    """One text per malformed block, written for the model to read and correct."""
    truncated: bool = False
    """The text ends inside a call: in its opening tag, or in a block that never closed."""
    repeats: int = 0
    """Calls dropped because an earlier call of the same text had the same name and arguments."""


def format_tool_call(call: ToolCall) -> str:
    """One block: ``<tool_call>\\n{"name": "clock", "arguments": {}}\\n</tool_call>``."""
    body = json.dumps({"name": call.name, "arguments": call.arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}\n{body}\n{TOOL_CALL_CLOSE}"


def format_tool_calls(calls: Sequence[ToolCall]) -> str:
    """The blocks of ``calls`` separated by newlines (the text an assistant turn renders to).

    ``format_tool_calls([ToolCall(name="clock")])``
    """
    return "\n".join(format_tool_call(call) for call in calls)


def parse_tool_calls(text: str) -> ParsedOutput:
    """Split ``text`` into content, tool calls and error texts; never raises on model output.

    A block's JSON object decides where the block ends (so a ``</tool_call>`` inside a JSON
    string does not cut it); a block whose close tag is missing ends at the next
    ``<tool_call>`` or at the end of text. A call identical to an earlier one (same name, same
    arguments) is dropped: one model call never runs the same call twice. Text that ends in
    part of an opening tag at the start of a line (``"<"``, ``"<tool"``) is a cut call, not
    content.
    ``parse_tool_calls('Sure.\\n<tool_call>\\n{"name": "clock", "arguments": {}}\\n</tool_call>')``
    """
    pieces: list[str] = []
    calls: dict[str, ToolCall] = {}
    errors: list[str] = []
    position = blocks = repeats = 0
    truncated = False
    while (start := text.find(TOOL_CALL_OPEN, position)) >= 0:
        pieces.append(text[position:start])
        blocks += 1
        parsed, position = _read_block(text, start + len(TOOL_CALL_OPEN), blocks)
        if isinstance(parsed, str):
            errors.append(parsed)
            truncated = position == len(text) and not text.endswith(TOOL_CALL_CLOSE)
        elif (key := call_key(parsed)) in calls:
            repeats += 1
        else:
            calls[key] = parsed
    tail = text[position:]
    if cut := partial_open_tag(tail):
        tail, truncated = tail[:-cut], True
        errors.append(f"tool call {blocks + 1}: cut off in its opening tag {text[-cut:]!r}; {_FIX}")
    pieces.append(tail)
    content = "\n".join(piece.strip() for piece in pieces if piece.strip())
    return ParsedOutput(content, tuple(calls.values()), tuple(errors), truncated, repeats)


def partial_open_tag(text: str) -> int:
    """Length of the start of an opening tag that ``text`` ends in, 0 if none: a proper prefix
    of ``<tool_call>`` alone on its line (``partial_open_tag("Sure.\\n<tool") == 5``)."""
    return cut_tag_at_line_start(text, TOOL_CALL_OPEN)


def call_key(call: ToolCall) -> str:
    """What makes two calls the same: the name and the arguments (key order aside)."""
    return json.dumps([call.name, call.arguments], sort_keys=True, ensure_ascii=False)


def _read_block(text: str, body_start: int, index: int) -> tuple[ToolCall | str, int]:
    """The call (or error text) of the block whose body starts at ``body_start``, and where the
    text after the block starts."""
    json_start = len(text) - len(text[body_start:].lstrip())
    try:
        payload, json_end = _DECODER.raw_decode(text, json_start)
    except json.JSONDecodeError:
        payload, json_end = None, json_start
    after = len(text) - len(text[json_end:].lstrip())
    if payload is not None and text.startswith(TOOL_CALL_CLOSE, after):
        return _call_from(payload, index), after + len(TOOL_CALL_CLOSE)
    if payload is not None and (after == len(text) or text.startswith(TOOL_CALL_OPEN, after)):
        return _call_from(payload, index), after
    close = text.find(TOOL_CALL_CLOSE, body_start)
    reopen = text.find(TOOL_CALL_OPEN, body_start)
    if close >= 0 and (reopen < 0 or close < reopen):
        return _parse_body(text[body_start:close], index), close + len(TOOL_CALL_CLOSE)
    end = reopen if reopen >= 0 else len(text)
    return _parse_body(text[body_start:end], index), end


def _parse_body(body: str, index: int) -> ToolCall | str:
    """The call in one block's body, or an error text naming the block and the fix."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as error:
        where = f"line {error.lineno} column {error.colno}"
        return f"tool call {index}: invalid JSON ({error.msg} at {where}); {_FIX}"
    return _call_from(payload, index)


def _call_from(payload: Any, index: int) -> ToolCall | str:
    """The call a decoded block describes, or an error text naming the block and the fix."""
    where = f"tool call {index}"
    if not isinstance(payload, dict):
        return f"{where}: expected a JSON object, got {type(payload).__name__}; {_FIX}"
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        return f'{where}: "name" is missing or not a non-empty string; {_FIX}'
    arguments = payload.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'{where}: "arguments" of {name!r} is a string that is not JSON; {_FIX}'
    if not isinstance(arguments, dict):
        return f'{where}: "arguments" of {name!r} must be a JSON object; {_FIX}'
    return ToolCall(name=name.strip(), arguments=arguments)


def tool_call_grammar(
    tools: Sequence[dict[str, Any]],
    tool_choice: str,
    *,
    max_string_length: int = 200,
    max_items: int = 16,
    parallel: bool = True,
    max_calls: int = 4,
    answer_schema: dict[str, Any] | None = None,
) -> str:
    """An llguidance Lark grammar for the model's whole answer under ``tool_choice``.

    ``"required"``: call blocks, each calling one of ``tools``; a tool's name: blocks calling
    that tool; ``"auto"``: call blocks, or text that never contains ``<tool_call>``. With
    ``parallel`` (OpenAI's ``parallel_tool_calls``, default) an answer may hold 1 to
    ``max_calls`` blocks, one per line as ``format_tool_calls`` writes them; without, exactly
    one. (The bound keeps a weak model from repeating calls until its token budget cuts the
    last one: measured on the default model, unbounded answers ran to ``max_new_tokens``.) The
    arguments follow the tool's JSON schema closed and bounded by ``bounded_schema`` (one rule
    for ``@tool``s and raw schemas: no call invents keys), in ``json.dumps`` layout. ``"none"``
    needs no grammar (pass no constraint) and raises ``ValueError``, as do unknown names and
    malformed tools.

    ``answer_schema`` (structured output): under ``"auto"`` the answer that is not a call is
    JSON under that schema instead of free text.

    ``factory(tool_call_grammar([calculator.schema_for_prompt()], "required"))``
    """
    chosen = chosen_tools(tools, tool_choice)
    open_tag, close_tag = lark_literal(TOOL_CALL_OPEN + "\n"), lark_literal("\n" + TOOL_CALL_CLOSE)
    answer = "answer" if answer_schema is not None else "TEXT"
    lines = [
        f"start: tool_calls | {answer}" if tool_choice == "auto" else "start: tool_calls",
        *_call_list(max_calls if parallel else 1),
        f"tool_call: {open_tag} call_body {close_tag}",
        "call_body: " + " | ".join(f"call_{i}" for i in range(len(chosen))),
    ]
    for i, (name, parameters) in enumerate(chosen):
        head = lark_literal('{"name": ' + json.dumps(name) + ', "arguments": ')
        schema = bounded_schema(parameters, max_string_length=max_string_length, max_items=max_items)
        schema["x-guidance"] = {**schema.get("x-guidance", {}), **JSON_LAYOUT}
        lines.append(f'call_{i}: {head} arguments_{i} "}}"')
        lines.append(f"arguments_{i}: %json {json.dumps(schema, ensure_ascii=False)}")
    if tool_choice == "auto" and answer_schema is not None:
        lines.append(answer_rule(answer_schema))
    elif tool_choice == "auto":
        # NOTE: plain text may be anything non-empty that never contains the open tag, so an
        # answer is either prose or calls, never prose with a call in its middle.
        lines.append(f"TEXT: /(?s:.+)/ & ~/(?s:.*){re.escape(TOOL_CALL_OPEN)}(?s:.*)/")
    return "\n".join(lines) + "\n"


ANSWER_MAX_STRING_LENGTH = 2000
"""Strings in an answer schema without a ``maxLength`` get this one (a small model otherwise
fills an unbounded string until its token budget ends)."""
ANSWER_MAX_ITEMS = 64
"""…and arrays without a ``maxItems`` this one."""


def answer_rule(schema: dict[str, Any]) -> str:
    """The Lark rule ``answer``: JSON under ``schema`` (bounded), in ``json.dumps`` layout."""
    bounded = bounded_schema(schema, max_string_length=ANSWER_MAX_STRING_LENGTH, max_items=ANSWER_MAX_ITEMS)
    bounded["x-guidance"] = {**bounded.get("x-guidance", {}), **JSON_LAYOUT}
    return f"answer: %json {json.dumps(bounded, ensure_ascii=False)}"


def answer_grammar(schema: dict[str, Any]) -> str:
    """An llguidance Lark grammar for an answer that is JSON under ``schema`` and nothing else:
    ``answer_grammar({"type": "object", "properties": {"n": {"type": "integer"}}})``."""
    return f"start: answer\n{answer_rule(schema)}\n"


def _call_list(max_calls: int) -> list[str]:
    """Lark rules for 1..``max_calls`` call blocks separated by newlines (``tool_calls``)."""
    if max_calls < 1:
        raise ValueError(f"max_calls must be >= 1, got {max_calls}")
    rules = [f"tool_calls: tool_call{' more_1?' if max_calls > 1 else ''}"]
    for k in range(1, max_calls):
        rules.append(f'more_{k}: "\\n" tool_call{f" more_{k + 1}?" if k + 1 < max_calls else ""}')
    return rules


def chosen_tools(tools: Sequence[dict[str, Any]], tool_choice: str) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters)`` of the tools ``tool_choice`` lets the model call."""
    specs = [_name_and_parameters(tool) for tool in tools]
    names = [name for name, _ in specs]
    if not specs:
        raise ValueError("tool_call_grammar needs at least one tool; with no tools pass no constraint")
    if len(set(names)) != len(names):
        raise ValueError(f"tool names must be unique, got {names}")
    if tool_choice == "none":
        raise ValueError('tool_choice="none" needs no grammar: generate without a constraint')
    if tool_choice in ("required", "auto"):
        return specs
    if tool_choice in names:
        return [spec for spec in specs if spec[0] == tool_choice]
    raise ValueError(
        f'tool_choice must be "auto", "required", "none" or one of {names}, got {tool_choice!r}'
    )


def _name_and_parameters(tool: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, parameters schema)`` of an OpenAI-format tool dict (or a bare function dict)."""
    function = tool.get("function", tool) if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ValueError(
            'each tool must look like {"type": "function", "function": {"name": ..., "parameters": {...}}}, '
            f"got {tool!r}"
        )
    name = function["name"]
    if not TOOL_NAME_PATTERN.match(name):
        raise ValueError(f"tool name {name!r} is not allowed; use 1-64 letters, digits, '_', '-' or '.'")
    parameters = function.get("parameters") or _NO_ARGUMENTS
    if not isinstance(parameters, dict):
        raise ValueError(f"the parameters of tool {name!r} must be a JSON schema object, got {parameters!r}")
    return name, parameters


def lark_literal(text: str) -> str:
    """A Lark string literal matching exactly ``text`` (JSON escapes are Lark escapes)."""
    return json.dumps(text, ensure_ascii=False)


def tools_instructions(tools: Sequence[dict[str, Any]]) -> str:
    """An instruction, one JSON schema per line, and the ``<tool_call>`` format to call them
    (the system text for a template that cannot show tools itself):
    ``tools_instructions([calculator.schema_for_prompt()])``."""
    example = format_tool_calls([ToolCall(name="<tool name>", arguments={"<argument>": "<value>"})])
    return "\n".join(
        [
            "You can call these tools (one JSON schema per line):",
            *(json.dumps(tool, ensure_ascii=False) for tool in tools),
            "To call a tool, answer with one block per call, each on its own lines:",
            example,
        ]
    )
