"""Tool-call formats, one per model family, and which one a model writes, from what its chat
template and vocabulary say (Hermes when nothing matches).

``HERMES`` (``<tool_call>`` blocks: Qwen, and the fallback), ``LLAMA3_JSON`` (one bare
``{"name", "parameters"}``), ``MISTRAL`` (``[TOOL_CALLS][…]`` with 9-character ids),
``PHI4_MINI`` (``<|tool_call|>[…]<|/tool_call|>``)::

    fmt = detect_tool_format(tokenizer.chat_template, vocabulary)
    constraint = factory(fmt.grammar(tools, "required"))
    parsed = fmt.parse(result.text)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

from agentkv.chat.json_tool_formats import LLAMA3_JSON, MISTRAL, PHI4_MINI, JsonCallFormat
from agentkv.chat.tool_format import HERMES, HermesFormat, ToolCallFormat

__all__ = [
    "FORMATS",
    "HERMES",
    "LLAMA3_JSON",
    "MISTRAL",
    "PHI4_MINI",
    "HermesFormat",
    "JsonCallFormat",
    "ToolCallFormat",
    "detect_tool_format",
    "markup_tokens",
]

Clue = Callable[[str, Collection[str]], bool]

FORMATS: tuple[tuple[str, Clue, ToolCallFormat], ...] = (
    ("[TOOL_CALLS] is a token the template writes",
     lambda template, vocab: "[TOOL_CALLS]" in vocab and "[TOOL_CALLS]" in template, MISTRAL),
    ("<|tool_call|> is a token", lambda template, vocab: "<|tool_call|>" in vocab, PHI4_MINI),
    ('the template renders a call as {"name": …, "parameters": …} and has <|eot_id|>',
     lambda template, vocab: '"parameters": ' in template and "tool_call" in template and "<|eot_id|>" in template,
     LLAMA3_JSON),
    ("the template writes <tool_call>", lambda template, vocab: "<tool_call>" in template, HERMES),
)
"""First match wins; no match: ``HERMES``."""


def detect_tool_format(chat_template: str, vocabulary: Collection[str]) -> ToolCallFormat:
    """The format of the first row of ``FORMATS`` whose clue holds, else ``HERMES``; a format
    whose markup is control tokens learns their ids when ``vocabulary`` gives them (a token → id
    mapping, or a sequence indexed by id): ``detect_tool_format(template, tokenizer_vocab)``."""
    for _, clue, found in FORMATS:
        if clue(chat_template, vocabulary):
            if isinstance(found, JsonCallFormat):
                return found.with_special_ids(_ids(vocabulary, (found.open_tag, found.close_tag)))
            return found
    return HERMES


def _ids(vocabulary: Collection[str], tokens: Sequence[str]) -> dict[str, int]:
    """Ids of ``tokens`` that ``vocabulary`` holds (none when it is a plain set)."""
    if isinstance(vocabulary, Mapping):
        return {token: int(vocabulary[token]) for token in tokens if token and token in vocabulary}
    if isinstance(vocabulary, Sequence):
        return {token: vocabulary.index(token) for token in tokens if token and token in vocabulary}
    return {}


def markup_tokens(encode: Callable[[str], Sequence[int]]) -> dict[str, int]:
    """The formats' markup that is one token of a vocabulary, with its id (what
    ``detect_tool_format`` needs to know of it): ``markup_tokens(tokenizer.encode)``."""
    markup = {tag for _, _, found in FORMATS if isinstance(found, JsonCallFormat)
              for tag in (found.open_tag, found.close_tag) if tag}
    found_ids = {tag: list(encode(tag)) for tag in sorted(markup)}
    return {tag: ids[0] for tag, ids in found_ids.items() if len(ids) == 1}
