"""``agentkv serve`` on the default model, driven by the official ``openai`` client over a loopback
port: completions, streaming, a client-executed tool round trip, response_format, KV reuse of a
history resent whole, errors, a client that hangs up mid-stream, and a clean SIGTERM; a response
chain across a restart (on a tiny zoo model)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from zoo_helpers import ZOO

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.model

KEY = "sk-agentkv-test"
TINY_CHATML = ZOO / "qwen2_5"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class RunningServer:
    """``agentkv serve`` in a subprocess on a free loopback port, until ``stop`` (SIGTERM)."""

    def __init__(self, db: str, *args: str) -> None:
        port = free_port()
        env = {**os.environ, "AGENTKV_API_KEY": KEY}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "agentkv.cli.app", "serve", "--port", str(port), "--db", db, *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert self.process.stdout is not None
        deadline = time.monotonic() + 180
        line = ""
        while time.monotonic() < deadline:
            line = self.process.stdout.readline()
            if "serving" in line or self.process.poll() is not None:
                break
        if "serving" not in line:
            self.process.kill()
            errors = self.process.stderr.read() if self.process.stderr else ""
            pytest.fail(f"the server did not start: {line!r} {errors}")
        assert f"http://127.0.0.1:{port}/v1" in line
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0  # stops cleanly on SIGTERM


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    running = RunningServer(f"sqlite:///{tmp_path_factory.mktemp('serve') / 'agentkv.db'}", "--max-sessions", "8")
    yield running.url
    running.stop()


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


def test_models_are_listed_and_a_wrong_key_is_refused(server, client):
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_a_completion_and_its_stream_with_usage(client):
    messages = [{"role": "user", "content": "Say hello in one word."}]
    answer = client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=12)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].message.content
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > 0 and answer.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")


def test_a_client_executed_tool_round_trip_prefills_only_the_result(client):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_tokens=48)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    [tool_call] = choice.message.tool_calls
    assert tool_call.function.name == "get_weather" and "city" in json.loads(tool_call.function.arguments)
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": tool_call.id, "content": '{"temperature_c": 18}'}]
    second = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], temperature=0,
                                            max_tokens=24)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # NOTE: not cached >= first.usage.prompt_tokens: a call cut by max_tokens is generated again,
    # and usage sums the prompts of both model calls
    assert second.usage.prompt_tokens - cached <= 48  # the tool turn, not the history


def test_response_format_gives_json_under_the_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    answer = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Name the capital of France."}], temperature=0,
        max_tokens=40, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}})
    assert isinstance(json.loads(answer.choices[0].message.content)["city"], str)


def test_a_conversation_resent_whole_each_turn_prefills_only_each_new_turn(client):
    messages = [{"role": "system", "content": "You answer in one short sentence."}]
    cached = []
    for question in ("Name a fruit.", "Name a colour.", "Name an animal.", "Name a country.", "Name a river."):
        messages.append({"role": "user", "content": question})
        answer = client.chat.completions.create(model="any", messages=messages, temperature=0, max_tokens=16)
        usage = answer.usage
        cached.append(usage.prompt_tokens_details.cached_tokens)
        if len(cached) > 1:
            assert usage.prompt_tokens - cached[-1] <= 40  # the new turn (and the last answer's end)
        messages.append({"role": "assistant", "content": answer.choices[0].message.content})
    assert cached == sorted(cached) and cached[-1] > cached[1] > 0


def test_two_tenants_with_the_same_system_prompt_do_not_share_cached_prefixes(client):
    system = {"role": "system", "content": "You are the assistant of the city archive. " * 12}

    def cached(salt: str, question: str) -> int:
        answer = client.chat.completions.create(model="any", messages=[system, {"role": "user", "content": question}],
                                                temperature=0, max_tokens=4, extra_body={"cache_salt": salt})
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("alpha", "When does it open?") == 0
    assert cached("alpha", "Where is it?") > 100
    assert cached("beta", "When does it open?") == 0


def test_errors_come_back_as_openai_errors_with_their_status(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="any", messages=[{"role": "critic", "content": "x"}])
    with pytest.raises(openai.APIStatusError) as too_long:
        client.chat.completions.create(model="any", messages=[{"role": "user", "content": "word " * 9000}])
    assert too_long.value.status_code == 413


def hang_up_after(stream, events: int, server: str) -> None:
    """Read ``events`` events of ``stream``, close it, and wait (30 s at most) until the server
    runs nothing."""
    for seen, _ in enumerate(stream):
        if seen == events:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while httpx.get(server + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_client_hanging_up_mid_stream_cancels_the_run_and_the_server_goes_on(server, client):
    stream = client.chat.completions.create(
        model="any", messages=[{"role": "user", "content": "Write a long story about the sea."}],
        temperature=0, max_tokens=400, stream=True)
    hang_up_after(stream, 3, server)
    assert httpx.get(server + "/health").json()["running"] == 0
    again = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert again.choices[0].message.content is not None


def test_responses_chain_by_previous_response_id_across_a_server_restart(tmp_path):
    """What a restart keeps (stored responses, the chain, its KV snapshot) is the server's, not the
    model's: both servers serve the zoo's tiny Qwen2.5 (ChatML, as the default model), which starts
    in ~3 s instead of ~12."""
    db = f"sqlite:///{tmp_path / 'responses.db'}"
    model = ("--model", str(TINY_CHATML))
    running = RunningServer(db, *model)
    try:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key=KEY, max_retries=0)
        first = client.responses.create(model="any", instructions="You answer in one short sentence.",
                                        input="Name a fruit.", temperature=0, max_output_tokens=16)
        assert first.status in ("completed", "incomplete") and first.output_text
        second = client.responses.create(model="any", instructions="You answer in one short sentence.",
                                         input="Name a colour.", previous_response_id=first.id, temperature=0,
                                         max_output_tokens=16)
        live_new = second.usage.input_tokens - second.usage.input_tokens_details.cached_tokens
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens and live_new <= 40
    finally:
        running.stop()
    restarted = RunningServer(db, *model)
    try:
        client = openai.OpenAI(base_url=restarted.url + "/v1", api_key=KEY, max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        third = client.responses.create(model="any", instructions="You answer in one short sentence.",
                                        input="Name an animal.", previous_response_id=second.id, temperature=0,
                                        max_output_tokens=16)
        usage = third.usage
        # the history's KV came back from the snapshot: only the new turn was prefilled
        assert usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
        assert usage.input_tokens - usage.input_tokens_details.cached_tokens <= 40
        with pytest.raises(openai.ConflictError):  # an older response: the conversation has moved on
            client.responses.create(model="any", input="Again?", previous_response_id=first.id, max_output_tokens=4)
        client.responses.delete(third.id)
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(third.id)
    finally:
        restarted.stop()


def test_a_streamed_response_with_a_client_executed_function(client):
    tool = {"type": "function", "name": "get_weather", "description": "Current weather in a city.",
            "parameters": WEATHER["function"]["parameters"]}
    events = list(client.responses.create(model="any", input="What is the weather in Paris?", tools=[tool],
                                          tool_choice="required", temperature=0, max_output_tokens=48, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    [call] = [item for item in events[-1].response.output if item.type == "function_call"]
    assert call.name == "get_weather" and "city" in json.loads(call.arguments)
    answer = client.responses.create(model="any", previous_response_id=events[-1].response.id, tools=[tool],
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": '{"temperature_c": 18}'}],
                                     temperature=0, max_output_tokens=24)
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens - answer.usage.input_tokens_details.cached_tokens <= 48  # the result only


def test_hanging_up_on_a_chained_response_leaves_the_chain_continuable(server, client):
    first = client.responses.create(model="any", input="Say hi.", temperature=0, max_output_tokens=8)
    stream = client.responses.create(model="any", input="Write a long story about the sea.",
                                     previous_response_id=first.id, temperature=0, max_output_tokens=300, stream=True)
    hang_up_after(stream, 5, server)
    again = client.responses.create(model="any", input="Say bye.", previous_response_id=first.id, temperature=0,
                                    max_output_tokens=8)
    assert again.previous_response_id == first.id and again.output_text
    # the story's prompt left the window; the first exchange's KV is still reused
    assert again.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    assert again.usage.input_tokens <= first.usage.input_tokens + first.usage.output_tokens + 40
