"""``agentkv serve`` (a real subprocess on the default model) told to stop mid-stream: each open
stream ends properly — a chat stream with a final chunk carrying a finish reason and ``[DONE]``, a
Responses stream with ``response.failed`` — and the process exits 0 without cutting a response."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from test_server import KEY, RunningServer

pytestmark = pytest.mark.model

COUNT = "Count from 1 to 300, one number per line."


class StreamReader(threading.Thread):
    """Reads one streamed request's SSE data lines until the body ends."""

    def __init__(self, url: str, path: str, body: dict) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.data: list[str] = []
        self.deltas = threading.Semaphore(0)
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url + self.path, json=self.body, timeout=60,
                              headers={"Authorization": f"Bearer {KEY}"}) as response:
                for line in response.iter_lines():
                    if line.startswith("data:"):
                        self.data.append(line[5:].strip())
                        if "delta" in line:
                            self.deltas.release()
        except BaseException as error:  # a cut body: what the test is about
            self.error = error


def test_sigterm_mid_stream_ends_every_stream_with_a_final_event(tmp_path):
    server = RunningServer(f"sqlite:///{tmp_path / 'agentkv.db'}")
    chat = StreamReader(server.url, "/v1/chat/completions", {
        "model": "m", "stream": True, "max_tokens": 600, "temperature": 0,
        "messages": [{"role": "user", "content": COUNT}]})
    response = StreamReader(server.url, "/v1/responses", {
        "model": "m", "stream": True, "max_output_tokens": 600, "temperature": 0, "input": COUNT})
    for reader in (chat, response):
        reader.start()
    for reader in (chat, response):
        for _ in range(4):  # a few deltas in: both streams are mid-answer
            assert reader.deltas.acquire(timeout=120), reader.data
    server.stop()  # SIGTERM; exits 0
    for reader in (chat, response):
        reader.join(timeout=30)
        assert not reader.is_alive() and reader.error is None, reader.error
    assert chat.data[-1] == "[DONE]"
    last_chunk = json.loads(chat.data[-2])
    assert last_chunk["choices"][0]["finish_reason"] == "length"
    last_event = json.loads(response.data[-1])
    assert last_event["type"] == "response.failed" and last_event["response"]["status"] == "failed"
    assert "shutting down" in last_event["response"]["error"]["message"]
    stderr = server.process.stderr.read() if server.process.stderr else ""
    assert "without completing response" not in stderr, stderr
