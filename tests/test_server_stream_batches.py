"""ready_batches and joined_deltas (agentkv.server.stream_batches): what an async iterator yields
without waiting goes out in one batch; a wait ends a batch; errors, cancellations and closing
reach the iterator as they would without batching; and a streamed chat answer whose tokens are
ready at once goes out as one chunk carrying all its text, finished once."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator
from contextlib import aclosing

import anyio
import anyio.lowlevel
import httpx
import pytest

from agentkv.events import ReasoningDelta, TextDelta
from agentkv.server import create_app
from agentkv.server.stream_batches import joined_deltas, ready_batches
from agentkv.testing import ScriptedEngine
from agentkv.testing.scripted import ScriptedBackend


async def items_in_runs(*runs: list[str], log: list[str] | None = None) -> AsyncGenerator[str, None]:
    """Each run's items back to back, a wait on the event loop between two runs."""
    try:
        for number, run in enumerate(runs):
            if number:
                await anyio.sleep(0.001)
            for item in run:
                yield item
    finally:
        if log is not None:
            await anyio.lowlevel.checkpoint()  # NOTE: a clean-up that awaits, as a run's does
            log.append("closed")


async def batches_of(source: AsyncGenerator[str, None], **options: int) -> list[list[str]]:
    async with aclosing(ready_batches(source, **options)) as batches:
        return [batch async for batch in batches]


async def test_items_yielded_without_waiting_come_as_one_batch_and_a_wait_ends_it():
    assert await batches_of(items_in_runs(["a", "b", "c"], ["d"], ["e", "f"])) == [["a", "b", "c"], ["d"], ["e", "f"]]


async def test_a_batch_holds_at_most_max_batch_items():
    assert await batches_of(items_in_runs(["a", "b", "c", "d", "e"]), max_batch=2) == [["a", "b"], ["c", "d"], ["e"]]


async def test_a_source_that_waits_before_each_item_gives_one_item_batches():
    async def one_by_one() -> AsyncGenerator[int, None]:
        for item in range(3):
            await anyio.lowlevel.checkpoint()
            yield item

    async with aclosing(ready_batches(one_by_one())) as batches:
        assert [batch async for batch in batches] == [[0], [1], [2]]


async def test_an_empty_source_gives_no_batch():
    assert await batches_of(items_in_runs()) == []


async def test_the_items_ready_before_an_error_go_out_then_the_error():
    async def failing() -> AsyncGenerator[str, None]:
        yield "a"
        yield "b"
        raise RuntimeError("the model step failed")

    received: list[list[str]] = []
    with pytest.raises(RuntimeError, match="the model step failed"):
        async with aclosing(ready_batches(failing())) as batches:
            async for batch in batches:
                received.append(batch)
    assert received == [["a", "b"]]


async def test_a_cancellation_reaches_the_source_where_it_waits():
    seen: list[str] = []

    async def waits_forever() -> AsyncGenerator[str, None]:
        yield "a"
        try:
            await anyio.sleep_forever()
        except anyio.get_cancelled_exc_class():
            seen.append("cancelled")
            raise
        yield "never"

    received: list[list[str]] = []
    with anyio.move_on_after(0.05) as scope:
        async with aclosing(ready_batches(waits_forever())) as batches:
            async for batch in batches:
                received.append(batch)
    assert scope.cancelled_caught and received == [["a"]] and seen == ["cancelled"]


async def test_closing_the_batches_while_the_next_item_waits_lets_the_source_close_at_a_yield():
    log: list[str] = []
    source = items_in_runs(["a", "b"], ["c"], log=log)
    async with aclosing(source):  # NOTE: the owner closes the source, as the chat stream does its run
        async with aclosing(ready_batches(source)) as batches:
            async for batch in batches:
                assert batch == ["a", "b"]  # the step toward "c" is under way: it finishes, "c" is dropped
                break
        assert log == []
    assert log == ["closed"]  # its clean-up, which awaits, ran to its end


async def test_a_source_holding_a_cancel_scope_across_its_items_stays_in_one_task():
    async def scoped() -> AsyncGenerator[str, None]:
        with anyio.CancelScope():
            for run in (["a", "b"], ["c"]):
                await anyio.sleep(0.001)
                for item in run:
                    yield item

    assert await batches_of(scoped()) == [["a", "b"], ["c"]]


async def test_a_batch_below_one_item_is_refused():
    with pytest.raises(ValueError, match="max_batch must be at least 1"):
        await batches_of(items_in_runs(["a"]), max_batch=0)


def test_joined_deltas_join_runs_of_the_same_kind_and_keep_the_order():
    result = object()
    batch = [ReasoningDelta("Let me "), ReasoningDelta("think."), TextDelta("Hel"), TextDelta("lo"), result]
    assert joined_deltas(batch) == [ReasoningDelta("Let me think."), TextDelta("Hello"), result]
    assert joined_deltas([TextDelta("a"), ReasoningDelta("b"), TextDelta("c")]) == \
        [TextDelta("a"), ReasoningDelta("b"), TextDelta("c")]


PANGRAM = "The quick brown fox jumps over the lazy dog."


async def stream_all_ready_at_once(monkeypatch, path: str, payload: dict) -> list[str]:
    """The ``data:`` lines of a stream from ``path`` whose answer (``PANGRAM``) has every token ready
    at once: no wait between the model's steps."""
    async def instant(self, fn, *args):
        return fn(*args)

    monkeypatch.setattr(ScriptedBackend, "run_blocking", instant)
    app = create_app(ScriptedEngine([PANGRAM]), model_id="scripted")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        async with client.stream("POST", path, json={"model": "scripted", "stream": True, **payload}) as response:
            return [line[6:] async for line in response.aiter_lines() if line.startswith("data: ")]


async def test_a_streamed_answer_ready_at_once_is_one_chunk_with_all_its_text_finished_once(monkeypatch):
    lines = await stream_all_ready_at_once(monkeypatch, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "A pangram?"}], "stream_options": {"include_usage": True}})
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(line) for line in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": ""}
    texts = [d["content"] for d in deltas[1:] if d.get("content")]
    generated = chunks[-1]["usage"]["completion_tokens"]
    assert texts == [PANGRAM] and generated > 1
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]].count("stop") == 1


async def test_a_streamed_response_ready_at_once_is_one_text_delta_event_and_completes_once(monkeypatch):
    lines = await stream_all_ready_at_once(monkeypatch, "/v1/responses", {"input": "A pangram?", "store": False})
    events = [json.loads(line) for line in lines]
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds.count("response.completed") == 1
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == [PANGRAM]
    assert events[-1]["response"]["usage"]["output_tokens"] > 1
