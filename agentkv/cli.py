"""The ``agentkv`` command: chat with a local model, list/show/export/remove stored sessions, resume.

::

    agentkv chat                      # new session on the default model, history in SQLite
    agentkv chat --session ID         # continue a stored session (same as `agentkv resume ID`)
    agentkv sessions list
    agentkv sessions export ID > chat.jsonl

Configuration is read here, at the edge: ``--db`` or ``$AGENTKV_DB_URL`` for the store,
``--model`` or ``$AGENTKV_MODEL`` for the model.
"""

from __future__ import annotations

import os
import sys
from typing import Optional

import anyio
import typer
from rich.console import Console
from rich.table import Table

from agentkv.agent import Agent
from agentkv.errors import AgentKVError
from agentkv.memory import Store

app = typer.Typer(help="agentkv: agents whose conversations keep their KV cache alive.", no_args_is_help=True)
sessions_app = typer.Typer(help="Stored sessions.", no_args_is_help=True)
app.add_typer(sessions_app, name="sessions")
out = Console()
err = Console(stderr=True)


def _store(db: str | None) -> Store:
    return Store(db) if db else Store.from_env()


def _agent(name: str, tools: bool) -> Agent:
    from agentkv.tools import calculator, clock

    return Agent(
        name=name,
        instructions="You are a helpful assistant. Answer briefly.",
        tools=[calculator, clock] if tools else (),
    )


async def _chat(session_id: str | None, agent_name: str, model: str | None, db: str | None,
                metrics: bool, tools: bool) -> None:
    from agentkv.engine.stateful import StatefulEngine
    from agentkv.runtime import Runtime

    store = _store(db)
    engine = StatefulEngine(model or os.environ.get("AGENTKV_MODEL") or None, num_slots=1)
    agent = _agent(agent_name, tools)
    runtime = Runtime(engine, store, agents=[agent])
    try:
        if session_id:
            record = await store.get_session(session_id)
            session = await runtime.resume(session_id, agent if record.agent_name == agent.name else None)
            report = runtime.last_resume
            err.print(f"resumed session {session_id}: {report.messages} messages, "
                      f"{report.restored_tokens} tokens of KV restored from a snapshot")
        else:
            session = await runtime.open_session(agent)
            err.print(f"session {session.id}")
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                out.print("[bold]you>[/bold] ", end="")
            line = await anyio.to_thread.run_sync(sys.stdin.readline)
            if not line:
                break
            text = line.strip()
            if not text:
                continue
            await _turn(runtime, session, text, metrics)
    finally:
        await runtime.aclose()
        await store.close()


async def _turn(runtime, session, text: str, metrics: bool) -> None:  # type: ignore[no-untyped-def]
    async for event in runtime.run_stream(session, text):
        if event.type == "text_delta":
            out.print(event.text, end="", markup=False, highlight=False)
        elif event.type == "tool_call":
            out.print(f"\n[dim]→ {event.call.name}({event.call.arguments})[/dim]")
        elif event.type == "tool_result":
            out.print(f"[dim]← {event.content}[/dim]")
        elif event.type == "turn_metrics" and metrics:
            m = event.metrics
            err.print(f"[dim]prompt {m.prompt_tokens} tok, reused {m.reused_tokens}, prefilled "
                      f"{m.prefilled_tokens}, generated {m.generated_tokens}, TTFT {m.ttft_s * 1000:.0f} ms[/dim]")
    out.print()


@app.command()
def chat(
    session: Optional[str] = typer.Option(None, "--session", "-s", help="Continue this stored session."),
    agent: str = typer.Option("assistant", "--agent", "-a", help="Agent name."),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="GGUF file or OpenVINO IR directory."),
    db: Optional[str] = typer.Option(None, "--db", help="SQLAlchemy URL of the store."),
    metrics: bool = typer.Option(False, "--metrics", help="Print per-turn token and timing metrics."),
    tools: bool = typer.Option(False, "--tools", help="Give the agent the calculator and clock tools."),
) -> None:
    """Chat on stdin; answers stream to stdout."""
    _guard(lambda: anyio.run(_chat, session, agent, model, db, metrics, tools))


@app.command()
def resume(
    session_id: str = typer.Argument(..., help="The stored session's id."),
    model: Optional[str] = typer.Option(None, "--model", "-m"),
    db: Optional[str] = typer.Option(None, "--db"),
    metrics: bool = typer.Option(False, "--metrics"),
) -> None:
    """Continue a stored session from its KV snapshot."""

    async def run() -> None:
        store = _store(db)
        record = await store.get_session(session_id)
        await store.close()
        await _chat(session_id, record.agent_name, model, db, metrics, False)

    _guard(lambda: anyio.run(run))


@sessions_app.command("list")
def sessions_list(db: Optional[str] = typer.Option(None, "--db")) -> None:
    """Every stored session, newest first."""

    async def run() -> None:
        async with _store(db) as store:
            table = Table("agent", "updated", "messages", "tokens")
            table.add_column("id", no_wrap=True, min_width=32)
            for s in await store.list_sessions():
                table.add_row(s.agent_name, s.updated_at.strftime("%Y-%m-%d %H:%M"),
                              str(s.message_count), str(s.total_tokens), s.id)
            out.print(table)

    _guard(lambda: anyio.run(run))


@sessions_app.command("show")
def sessions_show(session_id: str, db: Optional[str] = typer.Option(None, "--db")) -> None:
    """A session's history (messages out of the window are marked)."""

    async def run() -> None:
        async with _store(db) as store:
            await store.get_session(session_id)
            for m in await store.messages(session_id):
                flag = "" if m.in_window else " [dim](out of window)[/dim]"
                out.print(f"[bold]{m.message.role}[/bold]{flag}: ", end="")
                out.print(m.message.content, markup=False, highlight=False)

    _guard(lambda: anyio.run(run))


@sessions_app.command("export")
def sessions_export(session_id: str, db: Optional[str] = typer.Option(None, "--db")) -> None:
    """The history as JSONL in OpenAI chat-message format."""

    async def run() -> None:
        async with _store(db) as store:
            sys.stdout.write(await store.export_jsonl(session_id))

    _guard(lambda: anyio.run(run))


@sessions_app.command("rm")
def sessions_rm(session_id: str, db: Optional[str] = typer.Option(None, "--db")) -> None:
    """Delete a session: its rows and its snapshot files."""

    async def run() -> None:
        async with _store(db) as store:
            await store.get_session(session_id)
            await store.delete_session(session_id)
            err.print(f"deleted {session_id}")

    _guard(lambda: anyio.run(run))


def _guard(action) -> None:  # type: ignore[no-untyped-def]
    try:
        action()
    except AgentKVError as error:
        err.print(f"[red]error:[/red] {error}")
        raise typer.Exit(1) from None


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
