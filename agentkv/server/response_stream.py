"""ResponseOutput: a run's events turned into a response's output items and the Responses stream
events that announce them (``response.output_text.delta``, ``response.output_item.added``…), each
with its ``sequence_number`` and checked by the openai package's event types. The final output
keeps the streamed order and item ids; a message's text is the recorded answer. A reasoning
model's thinking is a ``reasoning`` item before its model call's message or calls
(``response.reasoning_text.delta`` while it streams).

::

    output = ResponseOutput()
    for run_event in events:
        sse_events = output.feed(run_event)      # send these when streaming
    items = output.items(result)
"""

from __future__ import annotations

from typing import Any, get_args

from openai import BaseModel
from openai.types.responses import ResponseStreamEvent

from agentkv.events import ModelCallFinished, ReasoningDelta, RunEvent, TextDelta, ToolCalled, ToolReturned
from agentkv.result import RunResult
from agentkv.server.logprobs_wire import logprob_entries
from agentkv.server.response_wire import (
    function_call_item,
    function_output_item,
    message_item,
    new_id,
    reasoning_item,
    text_part,
)
from agentkv.server.wire import as_wire

STREAM_EVENTS: dict[str, type[BaseModel]] = {
    get_args(kind.model_fields["type"].annotation)[0]: kind for kind in get_args(get_args(ResponseStreamEvent)[0])}
"""The openai package's Responses stream event types, by their ``type`` (picking the class by
name checks an event in ~5 µs; validating against the union of all of them takes ~95)."""


class ResponseOutput:
    """Output items built from run events, in the order they happened."""

    def __init__(self) -> None:
        self._sequence = 0
        self._items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._thinking: dict[str, Any] | None = None
        """The reasoning item being streamed (its text so far under ``"_text"``)."""
        self._step_items: list[dict[str, Any] | None] = []
        """Per model call: its message item (None when it streamed no text)."""

    @property
    def sequence(self) -> int:
        """Stream events made so far."""
        return self._sequence

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """A stream event of ``kind`` with the next sequence number, checked by the openai
        package's event type of that name (one carrying a ``response`` was built by
        ``response_object``, which checks it)::

            output.event("response.output_text.delta", item_id="msg_1", output_index=0, content_index=0,
                         delta="Hi", logprobs=[])
        """
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        if "response" in fields:
            return event
        return as_wire(STREAM_EVENTS[kind].model_validate(event))

    def feed(self, run_event: RunEvent) -> list[dict[str, Any]]:
        """The stream events ``run_event`` makes (none for events the format has no place for)."""
        if isinstance(run_event, ReasoningDelta):
            return self._think(run_event.text)
        done = self._close_thinking()
        return [*done, *self._feed(run_event)]

    def _feed(self, run_event: RunEvent) -> list[dict[str, Any]]:
        if isinstance(run_event, TextDelta):
            events = [] if self._open is not None else self._open_message()
            self._open_text().append(run_event.text)
            entries = logprob_entries(run_event.logprobs)
            self._open_logprobs().extend(entries)
            return [*events, self.event("response.output_text.delta", item_id=self._open_id(),
                                        output_index=self._index(), content_index=0, delta=run_event.text,
                                        logprobs=entries)]
        if isinstance(run_event, ModelCallFinished):
            self._step_items.append(self._open)
            return self._close_message()
        if isinstance(run_event, ToolCalled):
            item = function_call_item(new_id("fc"), run_event.call)
            index = len(self._items)
            self._items.append(item)
            return [self.event("response.output_item.added", output_index=index,
                               item={**item, "arguments": "", "status": "in_progress"}),
                    self.event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                               delta=item["arguments"]),
                    self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=index, item=item)]
        if isinstance(run_event, ToolReturned):
            item = function_output_item(new_id("fco"), run_event.call.id, run_event.content)
            index = len(self._items)
            self._items.append(item)
            return [self.event("response.output_item.added", output_index=index, item=item),
                    self.event("response.output_item.done", output_index=index, item=item)]
        return []

    def items(self, result: RunResult, inputs: int) -> list[dict[str, Any]]:
        """The final output: the streamed items, each message holding its model call's recorded
        answer (``result.new_messages`` after the ``inputs`` the run started from)."""
        answers = [m for m in result.new_messages[inputs:] if m.role == "assistant"]
        for step, message in enumerate(answers):
            item = self._step_items[step] if step < len(self._step_items) else None
            if item is not None:
                streamed = item["content"][0]["logprobs"] if item["content"] else []
                item["content"] = [text_part(message.content, streamed)]
            elif message.content:
                self._items.append(message_item(new_id("msg"), message.content))
        return self._items

    # ---- the reasoning item being streamed ------------------------------------------------------
    def _think(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._thinking is None:
            item = reasoning_item(new_id("rs"), "", status="in_progress")
            self._thinking = {**item, "_text": []}
            self._items.append(self._thinking)
            events.append(self.event("response.output_item.added", output_index=len(self._items) - 1, item=item))
        self._thinking["_text"].append(text)
        index = self._items.index(self._thinking)
        return [*events, self.event("response.reasoning_text.delta", item_id=self._thinking["id"], output_index=index,
                                    content_index=0, delta=text)]

    def _close_thinking(self) -> list[dict[str, Any]]:
        if self._thinking is None:
            return []
        item, index = self._thinking, self._items.index(self._thinking)
        text = "".join(item.pop("_text"))
        item.update(reasoning_item(item["id"], text))
        self._thinking = None
        return [self.event("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    # ---- the message item being streamed --------------------------------------------------------
    def _open_message(self) -> list[dict[str, Any]]:
        item = message_item(new_id("msg"), "", status="in_progress")
        self._open = {**item, "_text": [], "_logprobs": []}
        self._items.append(self._open)
        index = self._index()
        return [self.event("response.output_item.added", output_index=index, item=item),
                self.event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                           part=text_part(""))]

    def _close_message(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        item, index = self._open, self._index()
        text, logprobs = "".join(item.pop("_text")), item.pop("_logprobs")
        item.update(status="completed", content=[text_part(text, logprobs)])
        self._open = None
        return [self.event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=text, logprobs=logprobs),
                self.event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                           part=text_part(text, logprobs)),
                self.event("response.output_item.done", output_index=index, item=dict(item))]

    def _open_text(self) -> list[str]:
        assert self._open is not None
        return self._open["_text"]  # type: ignore[no-any-return]

    def _open_logprobs(self) -> list[dict[str, Any]]:
        assert self._open is not None
        return self._open["_logprobs"]  # type: ignore[no-any-return]

    def _open_id(self) -> str:
        assert self._open is not None
        return str(self._open["id"])

    def _index(self) -> int:
        return self._items.index(self._open) if self._open is not None else len(self._items) - 1
