"""The chat's printer: a reasoning model's thinking goes to stderr, dim, and never into the answer."""

from __future__ import annotations

import io

from rich.console import Console

from agentkv.cli.display import TurnPrinter
from agentkv.events import ReasoningDelta, TextDelta


def test_thinking_is_printed_on_stderr_and_the_answer_on_stdout() -> None:
    out, err = io.StringIO(), io.StringIO()
    printer = TurnPrinter(Console(file=out, width=80), Console(file=err, width=80), metrics=False,
                          eos_token_id=None, max_new_tokens=16)
    printer.show(ReasoningDelta("plan it"))
    printer.show(TextDelta("The answer."))
    assert err.getvalue() == "plan it" and out.getvalue() == "The answer."
    assert printer.call_text == "The answer."
