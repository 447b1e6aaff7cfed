"""Reusing KV never changes the conversation: restored, offloaded and prefix-cached paths are
token-identical to the uninterrupted one, on every CPU-plugin behaviour.

Per profile (this CPU's defaults, dynamic quantisation 32, and off — see ``_numerics.py``; a profile
this CPU computes bit for bit as one already run is skipped), 4 three-turn conversations run on a
one-slot engine:

- U: uninterrupted, with the prefix cache off (its turn 1 is a cold start);
- V: the same turns with the prefix cache on (turn 1 starts from a cache hit); after turn 2
  another session takes the slot, so V's KV goes to host memory and comes back for turn 3;
- R: V's snapshot after turn 2, written to a file, resumed in a new process for turn 3.

Every turn's greedy answer must be identical token for token, and every reused path must
report ``kv_exact``. This holds because prefills are cut canonically (registered prefix
boundaries) and restores give the plugin back its own values (``engine/numerics.py``).

The property holds per conversation, and four cover every path: the first conversation's V turn 1
fills the prefix cache (a miss), the other three start from a hit, and each one takes the offload
(V) and new-process (R) paths; more topics only repeat those paths (12 did, for 2.8× the CPU time).

R's new process is one for the module (``resumer``): it imports agentkv and OpenVINO while the
first profile's conversations run here, then per profile builds a new engine and resumes from
the snapshot files alone (``_restore_worker.main``); it never holds a session of this process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from agentkv.engine.base import GenerationConfig

from _numerics import PROFILES, numerics_engine, skip_if_computed_as_before

pytestmark = pytest.mark.model

TESTS = Path(__file__).parents[1]
RESUMER = (
    "import sys, anyio, _restore_worker, _numerics, agentkv.engine.stateful.engine\n"
    "for line in sys.stdin:\n"
    "    anyio.run(_restore_worker.main, *line.split())\n"
    "    sys.stdout.flush()\n"
)
"""The new process: ``_restore_worker.main(profile, jobs_path)`` (a new engine each time) per line
read, its answer a JSON line."""
MAX_NEW = 12
CFG = GenerationConfig(max_new_tokens=MAX_NEW)
SYSTEM = "You are a patient tutor. Answer in one or two short sentences and end with a question."
TOPICS = ["volcanoes", "the moon", "bread", "chess"]


def user_turns(topic: str) -> list[str]:
    return [f"Tell me one fact about {topic}.", "Why is that so?", f"Give me a tip for learning more about {topic}."]


def first_prompt(engine, user: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    return engine.tokenizer.encode(engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True))


def system_ids(engine) -> list[int]:
    a, b = first_prompt(engine, "a"), first_prompt(engine, "b")
    return a[: next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)]


def next_prompt(engine, session_tokens, answer: tuple[int, ...], user: str) -> list[int]:
    """The log, the answer's last (never fed) token, its end marker, then the next user turn."""
    ids = list(session_tokens) + list(answer[-1:])
    end = engine.tokenizer.encode("<|im_end|>")
    if answer[-1:] != tuple(end):
        ids += end
    return ids + engine.tokenizer.encode(f"\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n")


async def run_turn(engine, session, prompt_of, answers, turn: int):
    prompt = prompt_of(turn, session, answers)
    result = await session.generate(prompt, CFG)
    answers.append(result.token_ids)
    return result.metrics


@pytest.fixture(scope="module")
async def resumer(tmp_path_factory: pytest.TempPathFactory
                  ) -> AsyncIterator[Callable[[str, Path], Awaitable[dict[str, Any]]]]:
    """``await resume(profile, jobs_path)``: ``_restore_worker``'s answer from the module's new process."""
    errors = tmp_path_factory.mktemp("resumer") / "stderr.txt"
    with errors.open("wb") as stderr:
        process = await anyio.open_process([sys.executable, "-c", RESUMER], cwd=TESTS, stderr=stderr)
    assert process.stdin is not None and process.stdout is not None
    stdin, lines = process.stdin, BufferedByteReceiveStream(process.stdout)

    async def answer() -> dict[str, Any]:
        with anyio.fail_after(300):
            while True:
                try:
                    line = (await lines.receive_until(b"\n", 1 << 26)).decode()
                except (anyio.EndOfStream, anyio.IncompleteRead):
                    pytest.fail(f"the resuming process ended: {errors.read_text(encoding='utf-8')[-3000:]}")
                if line.startswith("{"):
                    return dict(json.loads(line))

    async def resume(profile: str, jobs_path: Path) -> dict[str, Any]:
        if process.returncode is not None:
            pytest.fail(f"the resuming process ended earlier: {errors.read_text(encoding='utf-8')[-3000:]}")
        try:
            await stdin.send(f"{profile} {jobs_path}\n".encode())
            return await answer()
        except BaseException:
            if process.returncode is None:
                process.kill()  # NOTE: never read a late answer as the next profile's
            raise

    try:
        yield resume
    finally:
        with suppress(anyio.BrokenResourceError, OSError):
            await stdin.aclose()  # the process's loop ends
        with anyio.move_on_after(30):
            await process.wait()
        if process.returncode is None:
            process.kill()
        await process.aclose()


@pytest.mark.parametrize("profile", list(PROFILES))
async def test_restored_offloaded_and_cached_sessions_answer_like_the_uninterrupted_one(profile, tmp_path, monkeypatch,
                                                                                        resumer):
    await skip_if_computed_as_before(profile, __name__)
    engine = numerics_engine(profile, num_slots=1)
    system = system_ids(engine)
    engine.register_prefix(system)
    jobs, expected, offloads_before = [], [], engine.pool.offloads
    try:
        for topic in TOPICS:
            turns = user_turns(topic)

            def prompt_of(turn, session, answers):
                if turn == 0:
                    return first_prompt(engine, turns[0])
                return next_prompt(engine, session.tokens, answers[-1], turns[turn])

            uninterrupted = await engine.open_session()
            u_answers: list[tuple[int, ...]] = []
            with monkeypatch.context() as m:
                m.setattr(engine.backend, "prefix_cache", None)  # U never touches the cache: a cold start
                u_first = await run_turn(engine, uninterrupted, prompt_of, u_answers, 0)
                for turn in (1, 2):
                    await run_turn(engine, uninterrupted, prompt_of, u_answers, turn)
            await uninterrupted.close()
            assert u_first.prefix_cache_tokens == 0

            moved = await engine.open_session()
            v_answers: list[tuple[int, ...]] = []
            v_first = await run_turn(engine, moved, prompt_of, v_answers, 0)
            if topic != TOPICS[0]:  # the first conversation's turn 1 fills the cache
                assert v_first.prefix_cache_tokens == len(system) and v_first.kv_exact
            await run_turn(engine, moved, prompt_of, v_answers, 1)
            snapshot = await moved.snapshot()
            assert snapshot.lossless
            path = tmp_path / f"{topic}.kvsnap"
            snapshot.to_file(path)
            third = prompt_of(2, moved, v_answers)
            jobs.append({"snapshot": str(path), "prompt": third})
            intruder = await engine.open_session()
            await intruder.prefill([1, 2, 3])  # takes the only slot: V's KV goes to host memory
            await intruder.close()
            v_third = await run_turn(engine, moved, prompt_of, v_answers, 2)
            await moved.close()
            assert v_third.restored_tokens > 0 and v_third.kv_exact
            assert v_answers == u_answers, (topic, v_answers, u_answers)
            expected.append(list(u_answers[2]))
        assert engine.pool.offloads - offloads_before >= len(TOPICS)
    finally:
        await engine.aclose()
    jobs_path = tmp_path / "jobs.json"
    payload = {"system": system, "conversations": jobs, "max_new_tokens": MAX_NEW}
    jobs_path.write_text(json.dumps(payload), encoding="utf-8")
    resumed = await resumer(profile, jobs_path)
    assert resumed["answers"] == expected
    # each resume reused its snapshot (no silent re-prefill) and reports an exact KV
    assert all(restored > 0 and exact for restored, _, exact in resumed["metrics"]), resumed["metrics"]
    assert all(prefilled < len(job["prompt"]) // 2 for (_, prefilled, _), job in zip(resumed["metrics"], jobs))
