"""``/v1/responses`` taking its own output back as input (the OpenAI guide's pattern, and what
openai-agents' and pydantic-ai's Responses models send): an assistant message item produced in the
same step as function calls, in either order, is one assistant turn — stored or not."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def call_items(*cities: str) -> list[dict]:
    return [{"type": "function_call", "id": f"fc_{c}", "call_id": f"call_{c}", "name": "get_weather",
             "arguments": json.dumps({"city": c}), "status": "completed"} for c in cities]


def message_item(text: str) -> dict:
    return {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def outputs(*cities: str) -> list[dict]:
    return [{"type": "function_call_output", "call_id": f"call_{c}", "output": f"{c}: 3 C"} for c in cities]


@pytest.mark.parametrize("store", [True, False])
@pytest.mark.parametrize("order", ["calls_then_message", "message_then_calls"])
async def test_a_step_replayed_as_input_is_accepted_with_its_message_in_either_order(tmp_path: Path, store, order):
    engine = ScriptedEngine(["Both are cold."])
    app = create_app(engine, store=Store(f"sqlite:///{tmp_path / 'r.db'}"), model_id="scripted")
    step = ([*call_items("Oslo", "Rome"), message_item("Checking both.")] if order == "calls_then_message"
            else [message_item("Checking both."), *call_items("Oslo", "Rome")])
    replay = [{"role": "user", "content": "Weather in Oslo and Rome?"}, *step, *outputs("Oslo", "Rome")]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post("/v1/responses", json={"model": "m", "input": replay, "tools": [WEATHER],
                                                            "store": store})
    assert response.status_code == 200, response.text
    prompt = engine.calls[0].prompt_text
    assert prompt.count("Checking both.") == 1 and "Oslo: 3 C" in prompt and "Rome: 3 C" in prompt
    # one assistant turn: its text, then its two calls, then the two results
    assert prompt.index("Checking both.") < prompt.index('"Oslo"') < prompt.index('"Rome"') < prompt.index("Oslo: 3 C")
    engine.assert_complete()
