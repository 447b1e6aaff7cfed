"""Persistence end to end: resume from a KV snapshot in a new process, corrupt snapshots.

The tests here run the real model; the scripted ones (crash safety, cross-process leases) are in
``tests/test_persistence.py``; the CLI's chat, sessions and resume commands on the real model are
one test in ``tests/model/test_cli_model.py``."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys

import anyio
import pytest
from test_persistence import AGENT, ROOT, WORKER

from agentkv import Runtime
from agentkv.memory import Store

pytestmark = pytest.mark.model

RESUME_MAX_NEW = 32
"""Answer cap of the resume test: its answers are cut by length either way (the model runs on
past 256 tokens), and what it checks (same text, KV restored, only the new turn prefilled) holds
for any length; 32 instead of the agent's 256 saves three times 224 decode steps."""
RESUME_AGENT = dataclasses.replace(AGENT, generation=AGENT.generation.model_copy(
    update={"max_new_tokens": RESUME_MAX_NEW}))


async def test_resume_in_a_new_process_restores_the_kv_and_answers_as_the_original(engine, tmp_path):
    original = tmp_path / "a"
    original.mkdir()
    url_a = f"sqlite:///{original / 'agentkv.db'}"
    store = Store(url_a)
    runtime = Runtime(engine, store, agents=[RESUME_AGENT])
    session = await runtime.open_conversation(RESUME_AGENT, conversation_id="resume-me")
    await runtime.run(session, "Name three colours.")
    await runtime.aclose()
    await store.close()
    copy = tmp_path / "b"
    shutil.copytree(original, copy)
    # Continue in this process...
    store = Store(url_a)
    runtime = Runtime(engine, store, agents=[RESUME_AGENT])
    session = await runtime.resume("resume-me")
    expected = await runtime.run(session, "Now name three animals.")
    await runtime.aclose()
    await store.close()
    # ...and in a fresh process from the copied database and snapshot files.
    done = await anyio.run_process(
        [sys.executable, WORKER, "resume-turn", f"sqlite:///{copy / 'agentkv.db'}", "resume-me",
         "Now name three animals.", str(RESUME_MAX_NEW)], cwd=ROOT, check=True)
    report = json.loads(done.stdout.decode().strip().splitlines()[-1])
    assert report["text"] == expected.final_text
    assert report["restored"] > 0
    assert report["reused"] >= report["restored"]
    new_turn = len(engine.tokenizer.encode("Now name three animals.")) + 12
    assert report["prefilled"] <= new_turn  # only the new user turn, not the history


@pytest.mark.parametrize("backend", ["stateful", "paged"])
async def test_corrupt_snapshot_falls_back_to_reprefill_and_loses_nothing(backend, request, tmp_path):
    """The re-prefilled session answers as the intact KV would — on the stateful engine, whose
    decode steps and prefills compute the same KV for this model. On the paged engine a decode
    step runs another kernel than a prefill (~0.6 max abs logit apart, measured), so the KV of
    the answer re-prefilled is close to, not equal to, the decoded one: there the re-prefilled
    session must answer as a fresh prefill of the same history does."""
    engine = request.getfixturevalue(f"{backend}_engine")
    url = f"sqlite:///{tmp_path / 'agentkv.db'}"
    async with Store(url) as store:
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.open_conversation(AGENT, conversation_id="c")
        await runtime.run(session, "Say hi.")
        reference = await (session.kv.fork() if backend == "stateful" else engine.open_session())
        await runtime.aclose()
        (record,) = (await store.snapshots("c"))[:1]
        data = bytearray(record.path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        record.path.write_bytes(bytes(data))
        runtime = Runtime(engine, store, agents=[AGENT])
        session = await runtime.resume("c")
        assert session.resume_report.restored_tokens == 0
        assert session.resume_report.skipped_snapshots
        result = await runtime.run(session, "Say bye.")
        assert result.call_metrics[0].reused_tokens == 0  # re-prefilled
        # the same answer the intact KV gives
        prompt = session.render(AGENT).token_ids
        assert len([m for m in await store.messages("c")]) == 4
        expected_prompt = prompt[: result.call_metrics[0].prompt_tokens]
        check = await reference.generate(expected_prompt, AGENT.generation)
        assert check.text == result.final_text
        await reference.close()
        await runtime.aclose()
