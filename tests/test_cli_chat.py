"""``agentkv chat`` at the prompt: input a terminal can send, the chat's commands (/quit, /help, ...),
the engine it loads closed as it ends, help and ``conversations list`` at 80 columns. A scripted engine
stands in for the model; the fixtures and helpers are ``test_cli.py``'s."""

from __future__ import annotations

import pytest
from test_cli import cli, conversation_id_in, stored
from test_cli import db, engines, isolated_env  # noqa: F401  (fixtures; isolated_env is autouse)
from typer.testing import CliRunner

from agentkv.cli.app import app
from agentkv.testing import ScriptedEngine


# -- H: input a terminal can send (issue 23, item 5) -----------------------------------------

def test_invalid_utf8_on_stdin_is_replaced_and_the_next_line_still_runs(db, engines):
    engines.replies = [["Got it.", "Hi!"]]
    result = CliRunner().invoke(app, ["chat", "--db", db], input=b"\xff\xfe bad \xc3\x28\nSay hi.\n")
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "Hi!" in result.output
    assert "not valid UTF-8" in result.output
    first, second = engines[0].calls
    assert "\ufffd\ufffd bad \ufffd(" in first.prompt_text and "Say hi." in second.prompt_text
    (summary,) = stored(db, lambda s: s.list_conversations())
    assert summary.message_count == 4


def test_a_first_turn_that_stores_nothing_leaves_no_session_row(db, engines):
    engines.replies = [["Short."]]
    huge = "word " * 400                          # over the window: refused before it is recorded
    result = cli("chat", "--db", db, "--max-prompt-len", "300", "--max-new-tokens", "16",
                 input=f"{huge}\nhi\n")
    assert result.exit_code == 1, result.output   # the refused turn is reported; the next one ran
    assert "Short." in result.output
    (summary,) = stored(db, lambda s: s.list_conversations())
    assert summary.message_count == 2
    only_refused = cli("chat", "--db", db, "--max-prompt-len", "300", "--max-new-tokens", "16",
                       input=f"{huge}\n")
    assert only_refused.exit_code == 1, only_refused.output
    assert [s.id for s in stored(db, lambda s: s.list_conversations())] == [summary.id]


# -- I: chat commands, help at 80 columns, the tokens column (issue 23, item 20) ------------

def test_quit_and_exit_leave_the_chat_and_are_never_sent_to_the_model(db, engines):
    for command in ("/quit", "/exit", "  /QUIT  "):
        result = cli("chat", "--db", db, input=f"hi\n{command}\nnever sent\n")
        assert result.exit_code == 0, result.output
        assert [call.prompt_text.count("never sent") for call in engines[-1].calls] == [0]
        assert "/quit" in result.output            # the commands are shown at the start


def test_a_chat_closes_the_engine_it_loaded_when_it_ends(db, engines, monkeypatch):
    """The chat owns its engine: closed as the chat ends (KV blocks and compiled graphs freed now,
    for the next engine in the process), not left to the garbage collector."""
    closed: list[ScriptedEngine] = []
    real = ScriptedEngine.aclose

    async def recorded(self: ScriptedEngine) -> None:
        closed.append(self)
        await real(self)

    monkeypatch.setattr(ScriptedEngine, "aclose", recorded)
    assert cli("chat", "--db", db, input="hi\n/quit\n").exit_code == 0
    assert cli("chat", "--db", db, input="hi\n").exit_code == 0  # stdin ends: Ctrl-D
    assert closed == list(engines) and len(closed) == 2


def test_help_lists_the_chat_commands_and_stores_nothing(db, engines):
    result = cli("chat", "--db", db, input="/help\n")
    assert result.exit_code == 0, result.output
    for command in ("/quit", "/exit", "/help", "Ctrl-C", "Ctrl-D"):
        assert command in result.output
    assert engines[0].calls == [] and stored(db, lambda s: s.list_conversations()) == []


def test_an_unknown_command_says_so_and_is_not_sent(db, engines):
    result = cli("chat", "--db", db, input="/qiut\n")
    assert "unknown command /qiut" in result.output and engines[0].calls == []


def test_a_double_slash_sends_a_command_like_line_as_text(db, engines):
    result = cli("chat", "--db", db, input="//quit\n")
    assert result.exit_code == 0, result.output
    [call] = engines[0].calls
    assert "/quit" in call.prompt_text and "//quit" not in call.prompt_text


@pytest.mark.parametrize("args", [["--help"], ["chat", "--help"], ["serve", "--help"],
                                  ["conversations", "--help"], ["conversations", "list", "--help"]])
def test_help_is_readable_at_80_columns(args):
    result = CliRunner().invoke(app, args, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    too_long = [line for line in result.output.splitlines() if len(line) > 80]
    assert not too_long and "…" not in result.output, result.output


def test_sessions_list_fits_80_columns_and_names_its_token_column(db, engines):
    for _ in range(2):
        assert cli("chat", "--db", db, "--agent", "a-rather-long-agent-name", input="hi\n").exit_code == 0
    sid = stored(db, lambda s: s.list_conversations())[0].id
    assert cli("conversations", "fork", sid, "--db", db).exit_code == 0
    result = CliRunner().invoke(app, ["conversations", "list", "--db", db], env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    assert all(len(line) <= 80 for line in result.output.splitlines()), result.output
    assert "…" not in result.output
    summaries = stored(db, lambda s: s.list_conversations())
    for s in summaries:
        assert s.id in result.output                 # ids whole: they are what other commands take
        if s.parent_id:
            assert f"{s.parent_id[:8]}@{s.fork_seq}" in result.output
    assert "window" in result.output and "msgs" in result.output
    explained = cli("conversations", "list", "--help").output
    assert "window tokens" in explained and "KV" in explained


def test_tools_for_one_chat_do_not_become_the_default_agents_for_good(db, engines):
    with_tools = cli("chat", "--db", db, "--tools", input="hi\n")
    assert with_tools.exit_code == 0, with_tools.output
    assert '"calculator"' in engines[0].calls[0].prompt_text
    plain = cli("chat", "--db", db, input="hi\n")
    assert plain.exit_code == 0, plain.output
    assert '"calculator"' not in engines[1].calls[0].prompt_text
    without = cli("chat", "--db", db, "--no-tools", input="hi\n")
    assert without.exit_code == 0, without.output
    assert '"calculator"' not in engines[2].calls[0].prompt_text
    # the session that ran with tools resumes with them
    again = cli("resume", conversation_id_in(with_tools.output), "--db", db, input="more\n")
    assert again.exit_code == 0, again.output
    assert '"calculator"' in engines[3].calls[0].prompt_text
