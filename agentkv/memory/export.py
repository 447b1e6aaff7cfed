"""A stored conversation as JSONL in OpenAI chat-message format (``agentkv conversations export``).

The agent's system prompt comes first (it is an agent setting, not a stored message), then
every message; one out of the window (rewound, or compacted away by a policy) carries
``"agentkv": {"in_window": false, "seq": N}`` so the export never passes it off as live::

    jsonl = conversation_jsonl("Be brief.", await store.messages(sid))
"""

from __future__ import annotations

import json
from typing import Any

from agentkv.chat.messages import Message
from agentkv.memory.records import StoredMessage


def conversation_jsonl(instructions: str | None, stored: list[StoredMessage]) -> str:
    """One JSON object per line: the system prompt (if any), then each message in order."""
    lines: list[dict[str, Any]] = []
    if instructions is not None:
        lines.append(Message.system(instructions).to_openai())
    for item in stored:
        line = item.message.to_openai()
        if not item.in_window:
            line["agentkv"] = {"in_window": False, "seq": item.seq}
        lines.append(line)
    return "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
