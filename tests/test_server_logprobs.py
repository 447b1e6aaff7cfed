"""Log-probabilities on ``agentkv serve``: chat completions (``logprobs`` / ``top_logprobs``) and
Responses (``include: ["message.output_text.logprobs"]`` / ``top_logprobs``), streamed and not,
driven by the ``openai`` client in process on the scripted engine (whose distribution is fixed:
``agentkv.testing.decode.scripted_logprob``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import pytest

from agentkv.chat.stream_filter import MarkupFilter, VisibleTokens
from agentkv.engine.generation import TokenDelta, TokenLogprob
from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

openai = pytest.importorskip("openai")

KEY = "sk-logprobs"
USER = [{"role": "user", "content": "Hi"}]
ANSWER = "Hello there, friend!"
LOGPROBS_INCLUDE = ["message.output_text.logprobs"]


class Served:
    """The app on a scripted engine, with an ``openai.AsyncOpenAI`` bound to it in process."""

    def __init__(self, steps: list, tmp_path: Path) -> None:
        self.engine = ScriptedEngine(steps)
        app = create_app(self.engine, store=Store(f"sqlite:///{tmp_path / 'lp.db'}"), api_key=KEY,
                         model_id="scripted")
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test",
                                      headers={"Authorization": f"Bearer {KEY}"})
        self.openai = openai.AsyncOpenAI(base_url="http://test/v1", api_key=KEY, http_client=self.http,
                                         max_retries=0)


def assert_token_logprobs(entries, text: str, top: int) -> None:
    """One entry per token of ``text`` (their texts join to it); each with ``top`` alternatives,
    most likely first, whose probabilities sum to at most 1, and UTF-8 ``bytes`` of its token."""
    assert "".join(e.token for e in entries) == text
    for entry in entries:
        assert entry.logprob <= 0.0 and bytes(entry.bytes) == entry.token.encode("utf-8")
        assert len(entry.top_logprobs) == top
        values = [alternative.logprob for alternative in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1.0
        if top:  # the scripted engine's token is its most likely one, as greedy's is
            assert entry.top_logprobs[0].token == entry.token and values[0] == entry.logprob


async def test_chat_completions_return_each_tokens_logprob_and_top_alternatives_streamed_or_not(tmp_path):
    served = Served([ANSWER, ANSWER, ANSWER], tmp_path)
    client = served.openai
    plain = await client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=3)
    assert plain.choices[0].message.content == ANSWER
    assert_token_logprobs(plain.choices[0].logprobs.content, ANSWER, 3)
    stream = await client.chat.completions.create(model="m", messages=USER, logprobs=True, top_logprobs=2,
                                                  stream=True)
    chunks = [c async for c in stream]
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert_token_logprobs(streamed, ANSWER, 2)
    for c in chunks:  # each chunk carries the tokens of its own text
        if c.choices and c.choices[0].delta.content:
            assert "".join(e.token for e in c.choices[0].logprobs.content) == c.choices[0].delta.content
    without_top = await client.chat.completions.create(model="m", messages=USER, logprobs=True)
    assert_token_logprobs(without_top.choices[0].logprobs.content, ANSWER, 0)
    served.engine.assert_complete()


async def test_chat_completions_without_logprobs_return_none_and_compute_none(tmp_path):
    served = Served([ANSWER, ANSWER], tmp_path)
    plain = await served.openai.chat.completions.create(model="m", messages=USER)
    assert plain.choices[0].logprobs is None
    stream = await served.openai.chat.completions.create(model="m", messages=USER, stream=True)
    assert all(c.choices[0].logprobs is None for c in [c async for c in stream] if c.choices)
    assert all(call.config.logprobs is None for call in served.engine.calls)


async def test_responses_return_output_text_logprobs_when_included_streamed_or_not(tmp_path):
    served = Served([ANSWER, ANSWER, ANSWER], tmp_path)
    client = served.openai
    created = await client.responses.create(model="m", input="Hi", include=LOGPROBS_INCLUDE, top_logprobs=4)
    [message] = created.output
    assert_token_logprobs(message.content[0].logprobs, ANSWER, 4)
    stored = await client.responses.retrieve(created.id)
    assert stored.output[0].content[0].logprobs == message.content[0].logprobs
    async with client.responses.stream(model="m", input="Again", include=LOGPROBS_INCLUDE, top_logprobs=1,
                                       previous_response_id=created.id) as stream:
        events = [event async for event in stream]
        final = await stream.get_final_response()
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert_token_logprobs([lp for e in deltas for lp in e.logprobs], ANSWER, 1)
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert_token_logprobs(done.logprobs, ANSWER, 1)
    assert_token_logprobs(final.output[0].content[0].logprobs, ANSWER, 1)
    plain = await client.responses.create(model="m", input="Hi", store=False)
    assert plain.output[0].content[0].logprobs == []
    served.engine.assert_complete()


async def test_the_logprobs_of_hidden_tool_call_markup_are_hidden_too(tmp_path):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    served = Served(["Let me check. " + call], tmp_path)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    stream = await served.openai.chat.completions.create(model="m", messages=USER, tools=tools, logprobs=True,
                                                         stream=True)
    chunks = [c async for c in stream]
    shown = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    tokens = "".join(e.token for e in entries)
    # NOTE: the token that straddles the tag (" <") is reported: part of its text was shown
    assert shown == "Let me check. " and tokens.startswith(shown) and "<tool_call>".startswith(tokens[len(shown):])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_tokens_logprob_goes_out_with_the_first_text_shown_at_or_after_it():
    def lp(token: int) -> TokenLogprob:
        return TokenLogprob(token, str(token), -1.0)

    visible = VisibleTokens(MarkupFilter("<tool_call>"))
    assert visible.feed(TokenDelta(1, "Sure", lp(1))) == ("Sure", (lp(1),))
    assert visible.feed(TokenDelta(2, " <tool", lp(2))) == (" ", (lp(2),))
    assert visible.feed(TokenDelta(3, "", lp(3))) == ("", ())  # no text yet: held
    assert visible.feed(TokenDelta(4, "_call>", lp(4))) == ("", ())  # the tag: hidden with its tokens
    assert visible.feed(TokenDelta(5, "{}", lp(5))) == ("", ())
    assert visible.flush() == ("", ())
    plain = VisibleTokens(None)
    assert plain.feed(TokenDelta(1, "", lp(1))) == ("", ())
    assert plain.feed(TokenDelta(2, "ab", lp(2))) == ("ab", (lp(1), lp(2)))


@pytest.mark.parametrize("route, payload, param", [
    ("/v1/chat/completions", {"messages": USER, "top_logprobs": 3}, "logprobs=true"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": False, "top_logprobs": 0}, "logprobs=true"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/responses", {"input": "hi", "store": False, "top_logprobs": 2}, "include"),
    ("/v1/responses", {"input": "hi", "store": False, "include": LOGPROBS_INCLUDE, "top_logprobs": 21},
     "top_logprobs"),
])
async def test_invalid_logprob_requests_are_400s_that_say_what_to_send(tmp_path, route, payload, param):
    served = Served([], tmp_path)
    answer = await served.http.post(route, json={"model": "m", **payload})
    assert answer.status_code == 400, answer.text
    assert param in json.dumps(answer.json()["error"])
    assert served.engine.calls == []
