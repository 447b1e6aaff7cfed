"""The ``agentkv`` CLI and the stored-agent rebuild: scripted stdin, a temp database and home,
a scripted engine in place of the model where the model is not the point (issue 13, 5/7/8).

The tests here run the real model; the scripted ones are in ``tests/test_cli.py``."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from test_cli import cli, conversation_id_in, stored
from test_cli import db, isolated_env  # noqa: F401  (fixtures; isolated_env is autouse)
from zoo_helpers import ZOO

pytestmark = pytest.mark.model


ROOT = Path(__file__).resolve().parents[2]


def test_cli_chat_with_tools_and_a_system_prompt_lists_resumes_on_its_kv_exports_and_removes(db):
    """One CLI session through every stored-session command: ``chat`` with tools and a system
    prompt (an arithmetic question, so the tool call is a short one: a question the tools do not
    fit makes this model write a 228-token call), ``conversations list``, ``resume`` on the restored
    KV, ``conversations export`` (the agent's system prompt first), ``conversations rm``, ``conversations show``."""
    first = cli("chat", "--db", db, "--tools", "--system", "Use tools.", "--max-new-tokens", "24", "--metrics",
                input="What is 2 + 3?\n")
    assert first.exit_code == 0, first.output
    conversation_id = conversation_id_in(first.output)
    assert conversation_id in cli("conversations", "list", "--db", db).output
    again = cli("resume", conversation_id, "--db", db, input="Thanks.\n")
    assert again.exit_code == 0, again.output
    assert "resumed conversation" in again.output
    assert int(again.output.split("messages, ")[1].split()[0]) > 0, again.output  # tokens of KV restored
    exported = [json.loads(line)
                for line in cli("conversations", "export", conversation_id, "--db", db).output.splitlines()
                if line.strip()]
    roles = [m["role"] for m in exported]
    assert roles[:3] == ["system", "user", "assistant"] and roles.count("user") == 2, roles
    assert exported[0]["content"] == "Use tools.", exported[0]
    assert cli("conversations", "rm", conversation_id, "--db", db).exit_code == 0
    missing = cli("conversations", "show", conversation_id, "--db", db)
    assert missing.exit_code == 1 and "no conversation" in missing.output


class Child:
    """``python -m agentkv.cli.app chat`` with its stdout and stderr collected by threads."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "agentkv.cli.app", "chat", *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT)
        self.out: list[str] = []
        self.err: list[str] = []
        for stream, sink in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._collect, args=(stream, sink), daemon=True).start()

    @staticmethod
    def _collect(stream, sink: list[str]) -> None:
        while char := stream.read(1):
            sink.append(char)

    def send(self, line: str) -> None:
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def wait_for(self, check, what: str, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not check("".join(self.out), "".join(self.err)):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                raise AssertionError(f"never saw {what}: {''.join(self.out)!r} {''.join(self.err)!r}")
            time.sleep(0.02)


def test_ctrl_c_cancels_the_answer_keeps_the_session_and_twice_exits_130(db):
    """Signals, the stored conversation and the exit code are mechanics: the child runs the zoo's tiny
    random-weight Qwen2.5 (ChatML as the default model; it compiles in ~1 s where the default
    model's three graphs take ~13 CPU-s in a fresh process), which streams until it is stopped."""
    child = Child("--db", db, "--model", str(ZOO / "qwen2_5"), "--max-new-tokens", "400", "--metrics")
    try:
        child.send("Write a very long story about a dragon who learns to cook, in ten chapters.")
        child.wait_for(lambda out, err: len(out.strip()) >= 10, "the answer streaming")
        child.proc.send_signal(signal.SIGINT)
        child.wait_for(lambda out, err: "[cancelled]" in out, "[cancelled]")
        child.send("hi")
        child.wait_for(lambda out, err: err.count("\nprompt ") >= 1, "the second answer")
        child.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        child.proc.send_signal(signal.SIGINT)
        code = child.proc.wait(timeout=20)
        time.sleep(0.1)
        assert code == 130, "".join(child.err)[-3000:]
    finally:
        child.proc.kill()
        child.proc.wait()
    time.sleep(0.1)
    err = "".join(child.err)
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    (summary,) = stored(db, lambda s: s.list_conversations())
    messages = stored(db, lambda s: s.messages(summary.id))
    assert [m.message.role for m in messages] == ["user", "assistant", "user", "assistant"]
    partial = messages[1].message.content
    assert partial.strip() and partial.strip() in "".join(child.out)
    assert messages[3].message.content.strip()
