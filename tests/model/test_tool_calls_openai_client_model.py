"""Tool calls as the ``openai`` client sees them from ``agentkv serve`` (in process): raw-schema
tools get a grammar without invented keys, a parallel call cut by ``max_tokens`` is retried or
reported (never markup in ``content``, never a trailing message item), and identical calls in one
step come back once. The scripted engine replays the model; one test runs the issue's repro on the
real model (marked ``model``).

The tests here run the real model; the scripted ones are in ``tests/test_tool_calls_openai_client.py``."""

from __future__ import annotations

import json

import pytest
from test_tool_calls_openai_client import arguments, chat, client_for, respond

from agentkv.chat.toolcalls import TOOL_CALL_OPEN

pytestmark = pytest.mark.model


async def test_the_issue_repro_on_the_model_gives_valid_calls_and_no_markup(engine, tmp_path):
    """Raw ``geo.distance``, ``tool_choice="required"``, 58 tokens: the default model's answer."""
    async with client_for(engine, tmp_path) as client:
        completion = await chat(client, 58)
        response = await respond(client, 58)
    choice = completion.choices[0]
    assert TOOL_CALL_OPEN[:2] not in (choice.message.content or "") and "<" not in response.output_text
    assert all(item.type != "message" for item in response.output)
    for calls, finish in ((choice.message.tool_calls or [], choice.finish_reason),
                          ([i for i in response.output if i.type == "function_call"], response.status)):
        args = arguments(calls)
        assert finish in ("tool_calls", "completed") and args, (finish, args)
        assert all(set(a) == {"start", "end"} and all(isinstance(v, str) for v in a.values()) for a in args)
        assert len({json.dumps(a, sort_keys=True) for a in args}) == len(args)  # no repeats
