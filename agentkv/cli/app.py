"""The ``agentkv`` command: chat with a local model, list/show/export/remove/unlock stored conversations, resume.

::

    agentkv chat                      # new conversation on the default model, history in SQLite
    agentkv chat --system "Be terse." --policy sliding --max-prompt-len 2048
    agentkv chat --conversation ID         # continue a stored conversation (same as `agentkv resume ID`)
    agentkv conversations list
    agentkv conversations export ID > chat.jsonl
    agentkv conversations unlock ID        # release the lease a crashed process left behind
    agentkv serve --port 8000         # an OpenAI-compatible server (``cli.serve``)

Configuration is read here, at the edge (``cli.config``): ``--db``, ``$AGENTKV_DB_URL`` or
``$AGENTKV_HOME`` for the store, ``--model`` or ``$AGENTKV_MODEL`` for the model, ``$AGENTKV_ENGINE``
for the engine (``open_engine``: paged on CPU/GPU unless it says ``stateful``). The chat
loop is in ``cli.chat``, the agent options in ``cli.agent``, printing in ``cli.display``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import anyio
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from agentkv.cli.agent import AgentOptions, PolicyName
from agentkv.cli.chat import EXIT_INTERRUPTED, ChatRequest, run_chat
from agentkv.cli.config import ENVIRONMENT_HELP, KVTierOptions, open_store, parse_age
from agentkv.chat.messages import pending_tool_calls
from agentkv.cli.display import format_call, conversations_table, show_message
from agentkv.cli.help_text import (AGENT_HELP, CHAT_POLICY_HELP, CHAT_TOOLS_HELP, DB_HELP, DRAIN_HELP, ENGINE_HELP,
                                   EXACT_HELP, KV_DISK_GB_HELP, KV_DISK_HELP, KV_HOST_HELP, KV_REUSE_HELP,
                                   LEASE_WAIT_HELP, MAX_SESSIONS_HELP, MODEL_HELP, SERVE_POLICY_HELP, CONVERSATION_HELP,
                                   SNAPSHOTS_HELP)
from agentkv.cli.models import models_app
from agentkv.errors import AgentKVError, UserError
from agentkv.memory.leases import DEFAULT_LEASE_WAIT_S, live_pid_here
from agentkv.memory.conversation_stats import conversation_stats

if TYPE_CHECKING:
    from agentkv.engine.factory import Backend

# NOTE: rich_markup_mode=None: click's plain help wraps at any width; rich's tables cut words at 80 columns
app = typer.Typer(help="agentkv: chat with a local model whose conversations keep their KV cache between "
                  "turns, store and resume them, or serve the model over the OpenAI API.",
                  epilog=ENVIRONMENT_HELP, no_args_is_help=True, rich_markup_mode=None)
conversations_app = typer.Typer(help="Stored conversations: list, show, fork, rewind, export or delete them, prune old "
                                "ones, unlock one a crashed process left leased.", no_args_is_help=True,
                                rich_markup_mode=None)
app.add_typer(conversations_app, name="conversations")
app.add_typer(models_app, name="models")
out = Console()
err = Console(stderr=True)

ENGINES: dict[str, Backend] = {"paged": "paged", "stateful": "stateful"}
"""``--engine`` values, and the engine backend each picks."""


@app.command(epilog=ENVIRONMENT_HELP)
def chat(
    conversation: Optional[str] = typer.Option(None, "--conversation", "-c", metavar="ID",
                                               help="Continue this stored conversation."),
    agent: Optional[str] = typer.Option(None, "--agent", "-a", metavar="NAME", help=AGENT_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="PATH", help=MODEL_HELP),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
    metrics: bool = typer.Option(False, "--metrics", help="Print token and timing metrics after each model call."),
    tools: Optional[bool] = typer.Option(None, "--tools/--no-tools", help=CHAT_TOOLS_HELP),
    system: Optional[str] = typer.Option(None, "--system", metavar="TEXT",
                                         help="The agent's instructions (system prompt)."),
    policy: Optional[PolicyName] = typer.Option(None, "--policy", case_sensitive=False, help=CHAT_POLICY_HELP),
    max_prompt_len: Optional[int] = typer.Option(
        None, "--max-prompt-len", min=1, metavar="TOKENS",
        help="Window in tokens: prompt plus answer (default: the model's context)."),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", min=1, metavar="TOKENS",
        help="Longest answer per model call; also the room kept for it (default: 256 tokens)."),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", min=0.0, metavar="T",
        help="0 picks the likeliest token each time (the default); higher samples more freely."),
) -> None:
    """Chat on stdin; answers stream to stdout. /help lists the commands, /quit (or Ctrl-D)
    leaves; Ctrl-C stops an answer, a second Ctrl-C exits."""
    options = AgentOptions(system=system, tools=tools, policy=policy, max_prompt_len=max_prompt_len,
                           max_new_tokens=max_new_tokens, temperature=temperature)
    _run_chat(ChatRequest(conversation, agent, options, model, db, metrics))


@app.command()
def resume(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    model: Optional[str] = typer.Option(None, "--model", "-m", metavar="PATH", help=MODEL_HELP),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
    metrics: bool = typer.Option(False, "--metrics", help="Print token and timing metrics after each model call."),
) -> None:
    """Continue a stored conversation with its stored agent, from its KV snapshot."""
    _run_chat(ChatRequest(conversation_id, None, AgentOptions(), model, db, metrics))


def _run_chat(request: ChatRequest) -> None:
    code = _guard(lambda: anyio.run(run_chat, request, out, err))
    if code:
        raise typer.Exit(code)


@conversations_app.command("list")
def conversations_list(db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP)) -> None:
    """Every stored conversation, newest first.

    Columns: id; agent; updated (UTC); messages: every stored message, in the window or out of
    it (a fork counts only its own); window tokens: the tokens of the messages still in the
    context window, as rendered into the prompt (what a resume's KV holds besides the system
    prompt and tool schemas; `conversations show ID --kv` gives the KV size in bytes); fork of: the
    parent and the fork point (parent@seq), shown when some conversation is a fork."""

    async def run() -> None:
        async with open_store(db) as store:
            out.print(conversations_table(await store.list_conversations()))

    _guard(lambda: anyio.run(run))


@conversations_app.command("show")
def conversations_show(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    kv: bool = typer.Option(False, "--kv", help="Also its KV: tokens, bytes, snapshots, reuse and what it "
                            "saved, compactions and cache breaks (with their causes); per model call, the tokens a "
                            "grammar forced, drafts proposed and the model accepted, and the steps that saved."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """A conversation's history: tool calls as name(arguments), messages out of the window marked."""

    async def run() -> None:
        async with open_store(db) as store:
            await store.get_conversation(conversation_id)
            for m in await store.messages(conversation_id):
                show_message(out, m.message, in_window=m.in_window)
            if kv:
                out.print()
                for line in (await conversation_stats(store, conversation_id)).lines():
                    out.print(line, markup=False, highlight=False)

    _guard(lambda: anyio.run(run))


@conversations_app.command("pending")
def conversations_pending(
    conversation_id: Optional[str] = typer.Argument(None, metavar="CONVERSATION_ID",
                                                    help="Only this conversation (default: every one)."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """Tool calls waiting in stored conversations: for a person's approval (given from Python:
    Runtime.approve or Runtime.reject) or for results the calling program runs and sends back."""

    async def run() -> None:
        async with open_store(db) as store:
            ids = [conversation_id] if conversation_id else [s.id for s in await store.list_conversations()]
            table = Table("conversation", "call id", "tool call")
            for sid in ids:
                window = [m.message for m in await store.messages(sid, in_window_only=True)]
                for call in pending_tool_calls(window).values():
                    table.add_row(sid, call.id, format_call(call))
            out.print(table if table.row_count else "no tool call is waiting")

    _guard(lambda: anyio.run(run))


@conversations_app.command("fork")
def conversations_fork(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    at: Optional[int] = typer.Option(None, "--at", min=0, metavar="SEQ", help="Share messages 1..AT (default: all)."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """A new conversation sharing this one's messages up to --at (not copied); prints its id. Its KV
    comes from the parent's snapshot when it is resumed."""

    async def run() -> None:
        async with open_store(db) as store:
            fork = await store.fork_conversation(conversation_id, at=at)
            out.print(f"forked {conversation_id} at {fork.fork_seq}: {fork.id}", highlight=False)

    _guard(lambda: anyio.run(run))


@conversations_app.command("rewind")
def conversations_rewind(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    before: int = typer.Option(..., "--before", min=1, metavar="SEQ",
                               help="The first message (seq) to take out of the window."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """Take message --before and every later one out of the conversation's window (they stay stored)."""

    async def run() -> None:
        async with open_store(db) as store:
            left = await store.rewind(conversation_id, before - 1)
            out.print(f"{left} messages left the window of {conversation_id}", highlight=False)

    _guard(lambda: anyio.run(run))


@conversations_app.command("prune")
def conversations_prune(
    older_than: Optional[str] = typer.Option(
        None, "--older-than", metavar="AGE", help="Delete conversations not updated for this long: 30d, 12h, 90m, 2w."),
    keep_snapshots: Optional[int] = typer.Option(
        None, "--keep-snapshots", min=1, metavar="N", help="Keep only the N newest snapshots of each conversation."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """Delete old conversations and surplus snapshots, and snapshot files no row points to (left by a
    crash). A parent whose forks stay is kept; a leased (running) conversation is never deleted."""

    async def run() -> None:
        age = parse_age(older_than) if older_than is not None else None
        async with open_store(db) as store:
            report = await store.prune(older_than=age, keep_snapshots=keep_snapshots)
        out.print(f"deleted {len(report.conversations)} conversations and {report.snapshots} snapshot files "
                  f"({report.orphan_files} orphaned), freed {report.bytes_freed / 1e6:.1f} MB", highlight=False)

    _guard(lambda: anyio.run(run))


@conversations_app.command("export")
def conversations_export(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    window: bool = typer.Option(False, "--window", help="Only the messages in the context window: the "
                                "conversation as the model reads it, a valid OpenAI messages list."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """The history as JSONL in OpenAI chat-message format: the agent's system prompt first, then
    every stored message; one out of the window (rewound, or compacted away by a policy) carries
    "agentkv": {"in_window": false, "seq": N}."""

    async def run() -> None:
        async with open_store(db) as store:
            sys.stdout.write(await store.export_jsonl(conversation_id, in_window_only=window))

    _guard(lambda: anyio.run(run))


@conversations_app.command("rm")
def conversations_rm(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """Delete a conversation: its rows and its snapshot files."""

    async def run() -> None:
        async with open_store(db) as store:
            await store.get_conversation(conversation_id)
            await store.delete_conversation(conversation_id)
            err.print(f"deleted {conversation_id}")

    _guard(lambda: anyio.run(run))


@conversations_app.command("unlock")
def conversations_unlock(
    conversation_id: str = typer.Argument(..., metavar="CONVERSATION_ID", help=CONVERSATION_HELP),
    force: bool = typer.Option(False, "--force", help="Release it even from a process still running on this "
                               "host: that run then stops at its next write, and a tool it is running "
                               "gets its result recorded by no one."),
    db: Optional[str] = typer.Option(None, "--db", metavar="URL", help=DB_HELP),
) -> None:
    """Release a conversation's lease left by a crashed or stuck process, so it can run again now.

    Refused while the holder is a process still running on this host (unless --force): stop
    it first. A holder on another host cannot be checked from here: make sure it is gone.
    """

    async def run() -> None:
        async with open_store(db) as store:
            current = (await store.get_conversation(conversation_id)).lease_holder
            pid = live_pid_here(current) if current is not None else None
            if pid is not None and not force:
                raise UserError(
                    f"conversation {conversation_id} is held by {current}, process {pid} still running on this host; "
                    f"stop it first (kill {pid}), or pass --force: its run then stops at its next write "
                    "and a tool call it is running gets no result from it")
            holder = await store.release_lease(conversation_id, force=True)
            if holder is None:
                err.print(f"conversation {conversation_id} was not leased; nothing to release", soft_wrap=True)
            else:
                err.print(f"released the lease of conversation {conversation_id}, held by {escape(str(holder))}"
                          + (f" (process {pid} still runs: its next write to the conversation will be refused)"
                             if pid is not None else ""), soft_wrap=True, highlight=False)

    _guard(lambda: anyio.run(run))


@app.command(epilog=ENVIRONMENT_HELP)
def serve(
    host: str = typer.Option("127.0.0.1", "--host", metavar="ADDRESS",
                             help="Address to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", min=1, max=65535, metavar="PORT", help="Port to listen on."),
    api_key: Optional[str] = typer.Option(
        None, "--api-key", metavar="TOKEN",
        help="Bearer token every request must send (default: $AGENTKV_API_KEY; none: open)."),
    db: Optional[str] = typer.Option(
        None, "--db", metavar="URL", help=DB_HELP + " Stored responses and their conversations live here."),
    model: Optional[str] = typer.Option(None, "--model", metavar="PATH", help=MODEL_HELP),
    engine: Optional[str] = typer.Option(None, "--engine", metavar="paged|stateful", help=ENGINE_HELP),
    max_sessions: int = typer.Option(64, "--max-sessions", min=1, metavar="N", help=MAX_SESSIONS_HELP),
    max_running: int = typer.Option(64, "--max-running", min=1, metavar="N",
                                    help="Requests served at once; more are refused with HTTP 429."),
    kv_reuse: bool = typer.Option(True, "--kv-reuse/--no-kv-reuse", help=KV_REUSE_HELP),
    system: Optional[str] = typer.Option(
        None, "--system", metavar="TEXT",
        help="System prompt of requests that send none (default: the chat template's)."),
    tools: Optional[bool] = typer.Option(
        None, "--tools/--no-tools",
        help="Offer the calculator and clock tools on every request, run by the server (default: none)."),
    policy: Optional[PolicyName] = typer.Option(None, "--policy", case_sensitive=False, help=SERVE_POLICY_HELP),
    max_prompt_len: Optional[int] = typer.Option(
        None, "--max-prompt-len", min=1, metavar="TOKENS",
        help="Window in tokens: prompt plus answer (default: the model's context)."),
    max_new_tokens: Optional[int] = typer.Option(
        None, "--max-new-tokens", min=1, metavar="TOKENS",
        help="Answer length of requests that set no max_tokens (default: 512 tokens)."),
    temperature: Optional[float] = typer.Option(
        None, "--temperature", min=0.0, metavar="T",
        help="Temperature of requests that set none (default: 1, as OpenAI's)."),
    snapshots: Optional[str] = typer.Option(None, "--snapshots", metavar="URL", help=SNAPSHOTS_HELP),
    kv_host_mb: int = typer.Option(256, "--kv-host-mb", min=0, metavar="MIB", help=KV_HOST_HELP),
    kv_disk: Optional[Path] = typer.Option(None, "--kv-disk", metavar="DIR", help=KV_DISK_HELP),
    kv_disk_gb: Optional[float] = typer.Option(None, "--kv-disk-gb", min=0.0, metavar="GIB", help=KV_DISK_GB_HELP),
    exact: bool = typer.Option(False, "--exact", help=EXACT_HELP),
    lease_wait: float = typer.Option(DEFAULT_LEASE_WAIT_S, "--lease-wait", min=0.0, metavar="SECONDS",
                                     help=LEASE_WAIT_HELP),
    drain_seconds: float = typer.Option(0.0, "--drain-seconds", min=0.0, metavar="SECONDS", help=DRAIN_HELP),
) -> None:
    """Serve the model over the OpenAI API: /v1/chat/completions, /v1/responses (stored, chained by
    previous_response_id across restarts), /v1/models. Prints the URL when ready; stops on SIGTERM."""
    from agentkv.cli.serve import ServeOptions
    from agentkv.cli.serve import serve as run_server

    if engine is not None and engine not in ENGINES:
        raise typer.BadParameter("--engine must be paged or stateful")
    agent = AgentOptions(system=system, tools=tools, policy=policy, max_prompt_len=max_prompt_len,
                         max_new_tokens=max_new_tokens, temperature=temperature)
    backend = None if engine is None else ENGINES[engine]
    options = ServeOptions(host, port, api_key, db, model, backend, max_sessions, max_running, kv_reuse, agent,
                           snapshots=snapshots, exact=exact, lease_wait_s=lease_wait, drain_s=drain_seconds,
                           kv_tiers=KVTierOptions(host_mib=kv_host_mb, disk=kv_disk, disk_gib=kv_disk_gb))
    _guard(lambda: run_server(options))


def _guard(action: Callable[[], int | None]) -> int | None:
    """Run ``action``; an agentkv error prints ``error: …`` and exits 1 (2 for a bad command
    line), a Ctrl-C exits 130 without a traceback."""
    try:
        return action()
    except BaseException as raised:
        error = _unwrap(raised)
        if isinstance(error, KeyboardInterrupt):
            raise typer.Exit(EXIT_INTERRUPTED) from None
        if not isinstance(error, AgentKVError):
            raise
        err.print(f"[red]error:[/red] {escape(str(error))}", highlight=False, soft_wrap=True)
        raise typer.Exit(getattr(error, "exit_code", 1)) from None


def _unwrap(error: BaseException) -> BaseException:
    """The single exception inside (nested) exception groups of one, else ``error``."""
    inner = getattr(error, "exceptions", None)
    while isinstance(inner, tuple) and len(inner) == 1:
        error = inner[0]
        inner = getattr(error, "exceptions", None)
    return error


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
