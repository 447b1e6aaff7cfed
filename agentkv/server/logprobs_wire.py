"""Log-probabilities in the OpenAI wire format: a run's ``TokenLogprob`` s as the openai package's
``ChatCompletionTokenLogprob`` (``{token, logprob, bytes, top_logprobs}``), the entry both APIs
share (chat ``logprobs.content``, Responses ``output_text.logprobs``).

::

    entries = token_logprobs(text_delta.logprobs)       # chat: a choice's logprobs.content
    part["logprobs"] = logprob_entries(text_delta.logprobs)   # Responses: the same entries as dicts
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion_token_logprob import TopLogprob

from agentkv.engine.generation import TokenLogprob


def token_logprobs(logprobs: Sequence[TokenLogprob]) -> list[ChatCompletionTokenLogprob]:
    """One entry per token: its text, log-probability, UTF-8 bytes, and its alternatives'
    (``bytes`` are those of the token's decoded text: a token that is part of a character
    decodes to U+FFFD)::

        token_logprobs(text_delta.logprobs)[0].top_logprobs
    """
    return [ChatCompletionTokenLogprob(token=lp.token, logprob=lp.logprob, bytes=list(lp.token.encode("utf-8")),
                                       top_logprobs=[TopLogprob(token=t.token, logprob=t.logprob,
                                                                bytes=list(t.token.encode("utf-8")))
                                                     for t in lp.top])
            for lp in logprobs]


def logprob_entries(logprobs: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``token_logprobs`` as wire dicts (a Responses ``output_text`` part's ``logprobs``)."""
    return [entry.model_dump(mode="json", exclude_unset=True) for entry in token_logprobs(logprobs)]
