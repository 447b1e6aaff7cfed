"""How the CLI prints: a run's events as they stream, end-of-answer markers, stored messages.

::

    printer = TurnPrinter(out, err, metrics=True, eos_token_id=tok.eos_token_id)
    async for event in runtime.run_stream(session, text):
        printer.show(event)
    printer.cancelled()                       # after Ctrl-C: "[cancelled]" on its own line
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from agentkv.chat.messages import Message, ToolCall
from agentkv.engine.generation import GenerationMetrics
from agentkv.events import RunEvent
from agentkv.memory.records import ConversationSummary
from agentkv.result import RunResult

FINISH_MARKERS = {
    "length": "[cut: max_new_tokens reached]",
    "tool_call_cut": "[cut: max_new_tokens reached inside a tool call]",
    "tool_call_invalid": "[stopped: the model's tool call did not parse]",
    "max_model_calls": "[stopped: max_model_calls reached]",
    "cancelled": "[cancelled]",
}
"""What to print after an answer, by ``RunResult.finish_reason`` ("stop" prints nothing)."""


def format_call(call: ToolCall) -> str:
    """``calculator({"expression": "17 * 23"})``."""
    return f"{call.name}({json.dumps(call.arguments, ensure_ascii=False)})"


def show_message(console: Console, message: Message, *, in_window: bool) -> None:
    """One stored message as ``role: content``; tool calls as ``→ name(arguments)`` lines."""
    flag = "" if in_window else " [dim](out of window)[/dim]"
    role = f"tool {message.name}" if message.role == "tool" and message.name else message.role
    console.print(f"[bold]{role}[/bold]{flag}: ", end="")
    lines = [message.content] if message.content or not message.tool_calls else []
    lines += [f"→ {format_call(call)}" for call in message.tool_calls]
    console.print("\n  ".join(lines), markup=False, highlight=False)


def conversations_table(sessions: list[ConversationSummary]) -> Table:
    """``conversations list``'s table, readable at 80 columns: ids whole (other commands take them),
    the agent name wraps, "fork of" only when some conversation is a fork."""
    forks = [f"{s.parent_id[:8]}@{s.fork_seq}" if s.parent_id else "" for s in sessions]
    table = Table(box=None, padding=(0, 1, 0, 0), pad_edge=False, header_style="bold underline")
    table.add_column("id", no_wrap=True, min_width=32)
    table.add_column("agent", overflow="fold", min_width=8)
    table.add_column("updated", no_wrap=True)
    table.add_column("msgs", justify="right", no_wrap=True)
    table.add_column("window tokens", justify="right", width=6)
    if any(forks):
        table.add_column("fork of", no_wrap=True, min_width=max(map(len, forks)))
    for s, fork in zip(sessions, forks):
        row = [s.id, s.agent_name, s.updated_at.strftime("%m-%d %H:%M"), str(s.message_count),
               str(s.in_window_tokens)]
        table.add_row(*row, *([fork] if any(forks) else []))
    return table


def finish_reason(result: RunResult, eos_token_id: int | None, max_new_tokens: int) -> str:
    """``result.finish_reason`` where the runtime reports it; otherwise "length" when the last
    answer used every allowed token and did not end with EOS, else "stop"."""
    reason = getattr(result, "finish_reason", None)
    if reason is not None:
        return str(reason)
    answers = [m for m in result.new_messages if m.role == "assistant"]
    if not answers or not result.call_metrics:
        return "stop"
    ids = answers[-1].token_ids or ()
    generated = result.call_metrics[-1].generated_tokens
    ended = bool(ids) and ids[-1] == eos_token_id
    return "length" if generated >= max_new_tokens and not ended else "stop"


class TurnPrinter:
    """Prints one run's events: answer text on stdout, metrics and notes on stderr, each
    starting on a line of its own. ``call_text`` is the text of the model call in progress."""

    def __init__(self, out: Console, err: Console, *, metrics: bool, eos_token_id: int | None,
                 max_new_tokens: int) -> None:
        self.out, self.err = out, err
        self.metrics = metrics
        self.eos_token_id = eos_token_id
        self.max_new_tokens = max_new_tokens
        self.call_text = ""
        self.finished = False
        self._at_line_start = True

    def show(self, event: RunEvent) -> None:
        """Print ``event`` (text deltas as they come, the rest on lines of their own)."""
        if event.type == "text_delta":
            self._text(event.text)
        elif event.type == "reasoning_delta":  # a reasoning model's thinking, dim, apart from the answer
            self.err.print(event.text, end="", style="dim", markup=False, highlight=False)
            self.err.file.flush()
        elif event.type == "tool_called":
            self._line(f"[dim]→ {_escape(format_call(event.call))}[/dim]")
        elif event.type == "tool_returned":
            self._line(f"[dim]← {_escape(event.content)}[/dim]")
        elif event.type == "model_call_finished":
            self.call_text = ""
            if self.metrics:
                m = event.metrics
                self._line(f"[dim]prompt {m.prompt_tokens} tok, reused {m.reused_tokens}, prefilled "
                           f"{m.prefilled_tokens}, generated {m.generated_tokens}{decode_figures(m)}, "
                           f"TTFT {m.ttft_s * 1000:.0f} ms[/dim]", console=self.err)
        elif event.type == "cache_broken":
            if self.metrics:  # NOTE: before the call's text: it explains the TTFT about to come
                self._line(f"[dim]{_escape(event.cache_break.describe())}[/dim]", console=self.err)
        elif event.type == "context_compacted":
            how = f"{event.policy} (fell back to {event.fallback})" if event.fallback else event.policy
            self._line(f"[dim]context compacted by {how}: {event.tokens_before} → "
                       f"{event.tokens_after} tokens[/dim]", console=self.err)
        elif event.type == "run_finished":
            self.finished = True
            reason = finish_reason(event.result, self.eos_token_id, self.max_new_tokens)
            self.end_line()
            if reason in FINISH_MARKERS:
                self._line(f"[yellow]{_escape(FINISH_MARKERS[reason])}[/yellow]")

    def cancelled(self) -> None:
        """Mark the answer as cut by Ctrl-C."""
        self._line(f"[yellow]{_escape(FINISH_MARKERS['cancelled'])}[/yellow]")

    def end_line(self) -> None:
        """Finish the current stdout line if text is on it."""
        if not self._at_line_start:
            self.out.print()
            self._at_line_start = True

    def _text(self, text: str) -> None:
        self.out.print(text, end="", markup=False, highlight=False)
        self.out.file.flush()
        self.call_text += text
        self._at_line_start = text.endswith("\n")

    def _line(self, markup: str, *, console: Console | None = None) -> None:
        self.end_line()
        target = console or self.out
        target.print(markup, highlight=False)
        target.file.flush()


def decode_figures(m: GenerationMetrics) -> str:
    """What fast-forward and drafts did, when they did anything: ``" (forced 24, drafted 10,
    accepted 8, 26 steps saved)"``; else ""."""
    if not (m.forced_tokens or m.drafted_tokens or m.steps_saved):
        return ""
    return (f" (forced {m.forced_tokens}, drafted {m.drafted_tokens}, accepted {m.accepted_tokens}, "
            f"{m.steps_saved} steps saved)")


def _escape(text: Any) -> str:
    from rich.markup import escape

    return escape(str(text))
