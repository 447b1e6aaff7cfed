"""``agentkv serve`` (a real subprocess) told to stop mid-stream: each open stream ends properly — a
chat stream with a final chunk carrying a finish reason and ``[DONE]``, a Responses stream with
``response.failed`` — and the process exits 0 without cutting a response.

The server runs the zoo's tiny Qwen2.5 (``TINY_CHATML``) on the default engine: what is tested is the
server's and the paged engine's shutdown, not the model's answers: the server process costs ~7 CPU-s
where the default model's took ~22, most of it compiling its graphs (measured, 2 avx2 cores). The
default model's server is ``test_server.py``'s."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from test_server import KEY, TINY_CHATML, RunningServer

pytestmark = pytest.mark.model

COUNT = "Count from 1 to 300, one number per line."
MAX_TOKENS = 3000
"""Both streams' cap: the tiny model decodes 3,000 tokens in 2-4 s, so SIGTERM comes mid-answer."""


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
    server = RunningServer(f"sqlite:///{tmp_path / 'agentkv.db'}", "--model", str(TINY_CHATML))
    chat = StreamReader(server.url, "/v1/chat/completions", {
        "model": "m", "stream": True, "max_tokens": MAX_TOKENS, "temperature": 0,
        "messages": [{"role": "user", "content": COUNT}]})
    response = StreamReader(server.url, "/v1/responses", {
        "model": "m", "stream": True, "max_output_tokens": MAX_TOKENS, "temperature": 0, "input": COUNT})
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
