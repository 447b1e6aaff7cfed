"""A database that cannot be written (read-only, full disk) is one named error — ``StoreUnavailable``
with the database's URL, the driver's cause and what to do — in the library and one line on the
CLI; clean-up that fails too (the lease release) never hides the first failure."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from sqlalchemy import event
from typer.testing import CliRunner

from agentkv import Agent, Runtime
from agentkv.chat.messages import Message
from agentkv.cli.app import app
from agentkv.errors import StoreUnavailable
from agentkv.memory.leases import LeaseKeeper, holder_id
from agentkv.memory import Store
from agentkv.testing import ScriptedEngine

AGENT = Agent(name="helper", instructions="Be brief.")


@contextmanager
def read_only(path: Path) -> Iterator[None]:
    """Make the file read-only for this process: chmod, or as root (who ignores modes) the
    immutable flag; skips the test where neither is possible."""
    if os.geteuid() != 0:
        path.chmod(0o444)
        try:
            yield
        finally:
            path.chmod(0o644)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode:
        pytest.skip("running as root without chattr +i: cannot make a file read-only here")
    try:
        yield
    finally:
        subprocess.run(["chattr", "-i", str(path)], check=True)


async def stored_session(url: str) -> str:
    store = Store(url)
    await store.upsert_agent(AGENT.name, AGENT.instructions, [], {})
    sid = (await store.create_conversation(AGENT.name)).id
    await store.append_message(sid, Message.user("hi"), token_count=2)
    await store.close()
    return sid


async def test_a_read_only_database_is_a_store_unavailable_naming_it_and_what_to_do(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = await stored_session(url)
    with read_only(tmp_path / "a.db"):
        store = Store(url)
        with pytest.raises(StoreUnavailable) as raised:
            await store.append_message(sid, Message.user("again"), token_count=2)
        await store.close()
    error = raised.value
    assert error.url == url and "readonly" in error.cause
    assert str(tmp_path / "a.db") in str(error) and "writable" in str(error) and "\n" not in str(error)


async def test_a_full_disk_is_a_store_unavailable_that_says_to_free_space(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = await stored_session(url)
    store = Store(url)
    pages = os.path.getsize(tmp_path / "a.db") // 4096 + 1
    # NOTE: SQLite's page limit fails a write exactly as a full disk does (SQLITE_FULL)
    event.listen(store.database.engine, "connect", lambda dbapi, _: dbapi.execute(f"PRAGMA max_page_count = {pages}"))
    with pytest.raises(StoreUnavailable, match="full.*free space on the database's disk"):
        for _ in range(100):
            await store.append_message(sid, Message.user("x" * 20_000), token_count=2)
    await store.close()


class FailingRelease(Store):
    """A store whose lease release fails too, with an error of its own."""

    releases = 0

    async def release_lease(self, conversation_id, holder=None, *, force=False):  # type: ignore[override]
        self.releases += 1
        raise StoreUnavailable(self.url, OSError("the release failed too"))


async def test_a_lease_release_failing_during_clean_up_keeps_the_error_that_ended_the_block(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = await stored_session(url)
    store = FailingRelease(url)
    with pytest.raises(ZeroDivisionError):
        async with LeaseKeeper(store, sid, holder_id()):
            1 / 0
    assert store.releases == 1
    await store.close()


async def test_a_run_on_a_read_only_database_raises_its_first_failure(tmp_path):
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = await stored_session(url)
    store = FailingRelease(url)
    runtime = Runtime(ScriptedEngine([]), store, agents=[AGENT])
    session = await runtime.resume(sid)
    await store.close()  # the next transactions open the file anew
    with read_only(tmp_path / "a.db"):
        with pytest.raises(StoreUnavailable, match="readonly") as raised:
            await runtime.run(session, "Hello?")
        with pytest.raises(StoreUnavailable, match="readonly"):
            await Runtime(ScriptedEngine([]), store, agents=[AGENT]).resume(sid)
        await store.close()
    assert store.releases >= 1 and "release failed" not in str(raised.value)


def test_the_cli_prints_one_line_naming_the_database_for_a_read_only_one(tmp_path):
    import anyio

    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = anyio.run(stored_session, url)
    with read_only(tmp_path / "a.db"):
        result = CliRunner().invoke(app, ["conversations", "rewind", sid, "--before", "1", "--db", url])
    assert result.exit_code == 1 and not isinstance(result.exception, StoreUnavailable | AssertionError)
    [line] = result.output.strip().splitlines()
    assert line.startswith("error: the database") and str(tmp_path / "a.db") in line and "writable" in line


def test_cli_chat_on_a_read_only_database_is_one_error_line_and_a_failing_exit(tmp_path, monkeypatch):
    import anyio

    monkeypatch.setattr("agentkv.cli.chat.load_engine", lambda model: ScriptedEngine(["Hi."] * 4))
    url = f"sqlite:///{tmp_path / 'a.db'}"
    sid = anyio.run(stored_session, url)
    with read_only(tmp_path / "a.db"):
        result = CliRunner().invoke(app, ["chat", "--conversation", sid, "--db", url], input="Hello?\n")
    errors = [line for line in result.output.splitlines() if "error" in line.lower()]
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit | None)
    assert len(errors) == 1 and str(tmp_path / "a.db") in errors[0] and "readonly" in errors[0], result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("url, says", [
    ("notaurl::", "is not a database URL"),
    ("foo://user@host/db", "cannot open foo://"),
    ("mysql://user@host/db", "install the driver"),
])
def test_a_database_url_that_cannot_be_used_is_one_line_naming_it(url, says):
    result = CliRunner().invoke(app, ["conversations", "list", "--db", url])
    assert result.exit_code == 1
    assert says in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1
