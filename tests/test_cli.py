"""The ``agentkv`` CLI and the stored-agent rebuild: scripted stdin, a temp database and home,
a scripted engine in place of the model where the model is not the point (issue 13, 5/7/8)."""

from __future__ import annotations

import inspect

import anyio
import pytest
from typer.testing import CliRunner

from agentkv import Agent, Runtime, calculator, clock
from agentkv.chat.messages import Message, ToolCall
from agentkv.cli.app import app
from agentkv.engine.base import GenerationConfig
from agentkv.errors import UserError
from agentkv.memory import Store
from agentkv.policies import SlidingWindow
from agentkv.runtime.stored_agent import agent_from_record
from agentkv.testing import ScriptedEngine

ENV_VARS = ("AGENTKV_HOME", "AGENTKV_DB_URL", "AGENTKV_MODEL")


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """No test reads the user's environment or writes to the user's data directory."""
    for name in ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))


@pytest.fixture
def db(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'a.db'}"


class Engines(list):
    """The ScriptedEngines the CLI loaded, in order; ``replies`` scripts the next ones."""

    def __init__(self) -> None:
        super().__init__()
        self.replies: list[list[str]] = []


@pytest.fixture
def engines(monkeypatch) -> Engines:
    """Each CLI invocation loads a new ScriptedEngine instead of the model."""
    made = Engines()

    def load(model):
        made.append(ScriptedEngine(made.replies.pop(0) if made.replies else ["OK."] * 4))
        return made[-1]

    monkeypatch.setattr("agentkv.cli.chat.load_engine", load)
    return made


def cli(*args: str, input: str | None = None):
    return CliRunner().invoke(app, list(args), input=input)


def conversation_id_in(output: str) -> str:
    return next(line.split()[1] for line in output.splitlines() if line.startswith("conversation "))


def stored(db: str, action):
    async def run():
        async with Store(db) as store:
            return await action(store)
    return anyio.run(run)


# -- A: resume rebuilds the stored agent ---------------------------------------------------

OPS = Agent(
    name="ops", instructions="Use tools for arithmetic.", tools=[clock, calculator],
    generation=GenerationConfig(max_new_tokens=77, temperature=0.3, seed=5, stop_strings=("END",)),
    tool_choice="calculator", max_model_calls=4, policy=SlidingWindow(), max_prompt_len=1500,
    min_response_len=100, truncate_oversized_messages=True, constrain_tool_calls=False,
    tool_timeout_s=9.0, settings={"team": "infra"},
)


async def test_agent_from_record_rebuilds_the_stored_agent(db):
    async with Store(db) as store:
        runtime = Runtime(ScriptedEngine([]), store, agents=[OPS])
        await runtime.open_conversation(OPS)
        rebuilt = agent_from_record(await store.get_agent("ops"))
    assert [t.name for t in rebuilt.tools] == ["clock", "calculator"]
    assert rebuilt.tools[1] is calculator
    assert isinstance(rebuilt.policy, SlidingWindow)
    fields = ("instructions", "generation", "tool_choice", "max_model_calls", "max_prompt_len",
              "min_response_len", "truncate_oversized_messages", "constrain_tool_calls",
              "tool_timeout_s", "settings")
    assert {f: getattr(rebuilt, f) for f in fields} == {f: getattr(OPS, f) for f in fields}


async def test_agent_from_record_names_a_tool_or_policy_it_cannot_rebuild(db):
    async with Store(db) as store:
        await store.upsert_agent("custom", "Add.", ["add"], {})
        await store.upsert_agent("odd", "Hi.", [], {"policy": "MyPolicy"})
        with pytest.raises(UserError, match=r"'add'.*resume\(conversation_id, agent\)"):
            agent_from_record(await store.get_agent("custom"))
        with pytest.raises(UserError, match="'MyPolicy'"):
            agent_from_record(await store.get_agent("odd"))


async def test_resume_without_the_agent_rebuilds_its_tools_and_restores_the_kv(db):
    async with Store(db) as store:
        first = Runtime(ScriptedEngine(["Four."]), store, agents=[OPS])
        session = await first.open_conversation(OPS, conversation_id="s")
        await first.run(session, "What is 2 + 2?")
        await first.aclose()
        second = Runtime(ScriptedEngine(["Again."]), store)
        resumed = await second.resume("s")
        assert [t.name for t in resumed.agent.tools] == ["clock", "calculator"]
        assert resumed.agent.instructions == OPS.instructions
        assert resumed.resume_report.restored_tokens > 0


def test_cli_resume_and_chat_session_use_the_stored_agent(db, engines):
    async def create(store):
        runtime = Runtime(ScriptedEngine(["Four."]), store, agents=[OPS])
        await runtime.run(await runtime.open_conversation(OPS, conversation_id="s"), "What is 2 + 2?")
        await runtime.aclose()

    stored(db, create)
    engines.replies = [["Sure."], ["Again."]]
    for args in (["resume", "s", "--db", db], ["chat", "--conversation", "s", "--db", db]):
        result = cli(*args, input="And 3 + 3?\n")
        assert result.exit_code == 0, result.output
        restored = int(result.output.split("messages, ")[1].split()[0])
        assert restored > 0, result.output
        prompt = engines[-1].calls[0].prompt_text
        assert "Use tools for arithmetic." in prompt and '"calculator"' in prompt
    record = stored(db, lambda store: store.get_agent("ops"))
    assert record.instructions == OPS.instructions and record.tool_names == ("clock", "calculator")


# -- B: a stored agent is never silently redefined ------------------------------------------

async def _store_helper(store):
    await store.upsert_agent("helper", "Answer in French.", [], {})


@pytest.mark.parametrize("options", [["--system", "Be terse."], ["--tools"]])
def test_chat_refuses_to_redefine_a_stored_agent(db, monkeypatch, options):
    stored(db, _store_helper)
    monkeypatch.setattr("agentkv.cli.chat.load_engine", lambda model: pytest.fail("model loaded"))
    result = cli("chat", "--agent", "helper", "--db", db, *options, input="hi\n")
    assert result.exit_code == 2, result.output
    assert "'helper'" in result.output and "nothing was changed" in result.output
    assert stored(db, lambda s: s.get_agent("helper")).instructions == "Answer in French."
    assert stored(db, lambda s: s.list_conversations()) == []


def test_chat_without_agent_options_uses_the_stored_agent(db, engines):
    stored(db, _store_helper)
    result = cli("chat", "--agent", "helper", "--db", db, input="hi\n")
    assert result.exit_code == 0, result.output
    assert "Answer in French." in engines[0].calls[0].prompt_text
    # options that leave instructions and tools alone apply on top of the stored agent
    result = cli("chat", "--agent", "helper", "--db", db, "--temperature", "0.5", input="hi\n")
    assert result.exit_code == 0, result.output
    assert "temperature 0.0 → 0.5" in result.output
    assert "Answer in French." in engines[1].calls[0].prompt_text
    assert engines[1].calls[0].config.temperature == 0.5
    assert stored(db, lambda s: s.get_agent("helper")).instructions == "Answer in French."


# -- C: no empty sessions ------------------------------------------------------------------

@pytest.mark.parametrize("typed", ["", "\n   \n"])
def test_leaving_chat_without_a_message_stores_no_session(db, engines, typed):
    result = cli("chat", "--db", db, input=typed)
    assert result.exit_code == 0, result.output
    assert stored(db, lambda s: s.list_conversations()) == []


# -- D: chat options -----------------------------------------------------------------------

@pytest.mark.parametrize("options", [
    ["--temperature", "-1"], ["--temperature", "nan"], ["--temperature", "warm"],
    ["--policy", "lru"], ["--max-new-tokens", "0"], ["--max-prompt-len", "0"],
    ["--max-prompt-len", "200"],                 # not more than the 256 tokens kept for the answer
    ["--max-prompt-len", "100000"],              # over the model's context (8192)
    ["--system", " "],
])
def test_bad_chat_options_exit_2_and_store_nothing(db, engines, options):
    result = cli("chat", "--db", db, *options, input="hi\n")
    assert result.exit_code == 2, result.output
    assert stored(db, lambda s: s.list_conversations()) == []


def test_chat_options_shape_the_agent(db, engines):
    result = cli("chat", "--db", db, "--system", "Be terse.", "--policy", "sliding", "--tools",
                 "--max-prompt-len", "2048", "--max-new-tokens", "64", "--temperature", "0.5",
                 input="hi\n")
    assert result.exit_code == 0, result.output
    (summary,) = stored(db, lambda s: s.list_conversations())
    assert summary.agent_name.startswith("assistant+system-") and summary.agent_name.endswith("+tools")
    agent = agent_from_record(stored(db, lambda s: s.get_agent(summary.agent_name)))
    assert agent.instructions == "Be terse."
    assert [t.name for t in agent.tools] == ["calculator", "clock"]
    assert isinstance(agent.policy, SlidingWindow)
    assert (agent.max_prompt_len, agent.min_response_len) == (2048, 64)
    config = engines[0].calls[0].config
    assert (config.max_new_tokens, config.temperature) == (64, 0.5)


# -- F: display ----------------------------------------------------------------------------

def test_sessions_show_prints_tool_calls_and_results(db):
    call = ToolCall(id="c1", name="calculator", arguments={"expression": "2 + 2"})

    async def create(store):
        await store.upsert_agent("a", "Hi.", ["calculator"], {})
        await store.create_conversation("a", conversation_id="s")
        for message in (Message.user("2+2?"), Message.assistant("", tool_calls=[call]),
                        Message.tool("4", tool_call_id="c1", name="calculator"),
                        Message.assistant("It is 4.")):
            await store.append_message("s", message, token_count=1)

    stored(db, create)
    result = cli("conversations", "show", "s", "--db", db)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert 'assistant: → calculator({"expression": "2 + 2"})' in lines
    assert "tool calculator: 4" in lines


def test_the_metrics_line_starts_on_a_line_of_its_own(db, engines):
    engines.replies = [["Hello there."]]
    result = cli("chat", "--db", db, "--metrics", input="hi\n")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "Hello there." in lines
    assert any(line.startswith("prompt ") for line in lines)


def test_an_answer_cut_by_max_new_tokens_is_marked(db, engines):
    engines.replies = [["one two three four five six seven eight"], ["Short."]]
    cut = cli("chat", "--db", db, "--max-new-tokens", "3", input="count\n")
    assert "[cut: max_new_tokens reached]" in cut.output.splitlines(), cut.output
    whole = cli("chat", "--db", db, input="again\n")
    assert "Short." in whole.output and "[cut" not in whole.output


def test_agentkv_home_holds_the_default_database_and_snapshots(tmp_path, monkeypatch, engines):
    home = tmp_path / "home"
    monkeypatch.setenv("AGENTKV_HOME", str(home))
    result = cli("chat", input="hi\n")
    assert result.exit_code == 0, result.output
    assert (home / "agentkv.db").is_file()
    sid = conversation_id_in(result.output)
    assert sid in cli("conversations", "list").output
    (snapshot,) = stored(f"sqlite:///{home / 'agentkv.db'}", lambda s: s.snapshots(sid))
    assert snapshot.path.is_relative_to(home / "snapshots") and snapshot.path.is_file()


def test_help_documents_the_environment_variables():
    result = cli("--help")
    for name in ("AGENTKV_HOME", "AGENTKV_DB_URL", "AGENTKV_MODEL", "AGENTKV_CACHE_DIR"):
        assert name in result.output


def test_model_conversion_names_the_final_directory(fake_gguf_conversion, capsys):
    from agentkv.engine.openvino import models

    files = models._ensure_ir_for_gguf(fake_gguf_conversion())
    message = capsys.readouterr().err
    assert str(files.ir_dir) in message.replace("\n", "")
    assert ".convert-" not in message


# -- G: conversations unlock --------------------------------------------------------------------

@pytest.mark.skipif("force" not in inspect.signature(Store.release_lease).parameters,
                    reason="Store.release_lease(conversation_id, force=True) has not landed yet")
def test_sessions_unlock_releases_a_stuck_lease(db):
    async def create(store):
        await store.upsert_agent("a", "Hi.", [], {})
        await store.create_conversation("a", conversation_id="s")
        await store.acquire_lease("s", "crashed-host:4242", 600)

    stored(db, create)
    result = cli("conversations", "unlock", "s", "--db", db)
    assert result.exit_code == 0, result.output
    assert "crashed-host:4242" in result.output
    stored(db, lambda store: store.acquire_lease("s", "me", 60))  # no ConversationBusy
    assert cli("conversations", "unlock", "nope", "--db", db).exit_code == 1


# -- J: export (issue 23, item 21) --------------------------------------------------------------

def test_sessions_export_starts_with_the_system_prompt_and_marks_rewound_messages(db, engines):
    import json

    engines.replies = [["One.", "Two."]]
    first = cli("chat", "--db", db, "--agent", "e", input="first\nsecond\n")
    sid = conversation_id_in(first.output)
    assert cli("conversations", "rewind", sid, "--before", "3", "--db", db).exit_code == 0
    exported = cli("conversations", "export", sid, "--db", db)
    assert exported.exit_code == 0, exported.output
    lines = [json.loads(line) for line in exported.output.splitlines()]
    assert lines[0] == {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
    assert [m["content"] for m in lines[1:]] == ["first", "One.", "second", "Two."]
    assert [m.get("agentkv", {}).get("in_window", True) for m in lines[1:]] == [True, True, False, False]
    window = cli("conversations", "export", sid, "--window", "--db", db)
    assert [json.loads(line)["content"] for line in window.output.splitlines()] == [lines[0]["content"],
                                                                                    "first", "One."]
