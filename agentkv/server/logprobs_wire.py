"""Log-probabilities in the OpenAI wire format: a run's ``TokenLogprob`` s as the ``{token,
logprob, bytes, top_logprobs}`` entries both APIs share (chat ``logprobs.content``, Responses
``output_text.logprobs``).

::

    entries = logprob_entries(text_delta.logprobs)
    choice["logprobs"] = chat_logprobs(entries)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentkv.engine.base import TokenLogprob


def logprob_entries(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """One entry per token: its text, log-probability, UTF-8 bytes, and its alternatives'
    (``bytes`` are those of the token's decoded text: a token that is part of a character
    decodes to U+FFFD)."""
    return [{**_entry(lp.token, lp.logprob), "top_logprobs": [_entry(t.token, t.logprob) for t in lp.top]}
            for lp in logprobs]


def chat_logprobs(entries: list[dict[str, Any]] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` (None when the request did not ask for them)."""
    return None if entries is None else {"content": entries, "refusal": None}


def _entry(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
