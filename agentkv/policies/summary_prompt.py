"""The summariser's prompt: messages as transcript lines, cut into chunks of bounded tokens.

Summarising in bounded chunks keeps the summariser inside its own window however much is
removed (summarisers that overflow their own window are a known failure)::

    lines = transcript_lines(messages)
    for chunk in chunk_lines(lines, tokenizer, max_tokens=768):
        request = chunk_request(chunk, summary_so_far)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from agentkv.chat.messages import Message

if TYPE_CHECKING:
    from agentkv.policies.protocol import TextTokenizer

SUMMARY_PREFIX = "Summary of earlier conversation:"
"""Every summary message's content starts with this."""
SUMMARIZER_INSTRUCTIONS = (
    "You summarise conversations. Write a short, factual summary of what was said, asked, "
    "decided and computed, keeping names, numbers and open questions. Answer with the summary "
    "only."
)


def transcript_lines(messages: Sequence[Message]) -> list[str]:
    """One line of text per message: ``["User: hi", "Assistant: hello"]``."""
    lines: list[str] = []
    for message in messages:
        if message.role == "assistant":
            if message.content:
                lines.append(f"Assistant: {message.content}")
            for call in message.tool_calls:
                arguments = json.dumps(call.arguments, ensure_ascii=False)
                lines.append(f"Assistant called tool {call.name} with {arguments}")
        elif message.role == "tool":
            lines.append(f"Tool {message.name or 'result'} returned: {message.content}")
        elif message.role == "user":
            lines.append(f"User: {message.content}")
        else:  # an earlier summary, or another system note
            lines.append(message.content)
    return lines


def chunk_lines(lines: Sequence[str], tokenizer: TextTokenizer, max_tokens: int) -> list[str]:
    """Join lines into chunks of at most ``max_tokens`` tokens; a longer line is split by tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    pieces: list[tuple[str, int]] = []
    for line in lines:
        ids = tokenizer.encode(line)
        for start in range(0, max(len(ids), 1), max_tokens):
            piece = ids[start : start + max_tokens]
            pieces.append((tokenizer.decode(piece) if len(ids) > max_tokens else line, len(piece)))
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for text, length in pieces:
        if current and size + length + 1 > max_tokens:
            chunks.append("\n".join(current))
            current, size = [], 0
        current.append(text)
        size += length + 1  # NOTE: +1 for the newline joining lines
    if current:
        chunks.append("\n".join(current))
    return chunks


def chunk_request(chunk: str, summary_so_far: str) -> str:
    """The user message asking for a summary of ``chunk`` (extending ``summary_so_far``)."""
    if summary_so_far:
        return (
            f"Summary so far:\n{summary_so_far}\n\nMore of the conversation:\n{chunk}\n\n"
            "Rewrite the summary so it also covers these messages."
        )
    return f"ConversationView:\n{chunk}\n\nSummarise this conversation."


def clean_summary(text: str) -> str:
    """The generated summary without surrounding space or an echoed ``SUMMARY_PREFIX``."""
    text = text.strip()
    if text.startswith(SUMMARY_PREFIX):
        text = text[len(SUMMARY_PREFIX) :].strip()
    return text
