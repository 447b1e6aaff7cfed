"""``agentkv chat``'s loop: read lines, run turns; Ctrl-C cancels an answer, a second one exits.

::

    code = anyio.run(run_chat, ChatRequest(conversation_id=None, agent_name=None, options=AgentOptions(),
                                           model=None, db=None, metrics=False), out, err)

SIGINT arrives through ``anyio.open_signal_receiver`` in a task of the loop's task group, so a
Ctrl-C is an anyio cancellation of the running turn (the engine finishes its current step, the
KV stays consistent, the lease is released), never a ``KeyboardInterrupt`` inside the loop. The
conversation is created at the first message, so opening and leaving a chat stores nothing.
"""

from __future__ import annotations

import math
import re
import signal
import sys
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TextIO

import anyio
import anyio.from_thread
import anyio.lowlevel
from rich.console import Console

from agentkv.agent import Agent
from agentkv.chat.messages import Message
from agentkv.cli.agent import AgentOptions, CLIUsageError, check_window, default_agent_name, resolve_agent
from agentkv.cli.config import model_choice, open_store
from agentkv.cli.display import TurnPrinter
from agentkv.run.conversation import Conversation
from agentkv.engine.base import Engine
from agentkv.errors import AgentKVError
from agentkv.memory import Store
from agentkv.memory.records import ConversationRecord
from agentkv.runtime.runtime import Runtime

EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT), as shells report it."""
DOUBLE_PRESS_S = 1.0
"""A second Ctrl-C within this many seconds exits, even if a new answer has started."""
START_NOTE = "Type a message and press Enter; /help lists the commands, /quit leaves."
"""Printed (on stderr) when a chat starts."""
HELP = """Commands (a line holding only the command):
  /help          this list
  /quit, /exit   leave the chat (as Ctrl-D at the start of a line does)
Ctrl-C stops the answer being written (the conversation stays usable); a second Ctrl-C leaves.
The conversation is stored from its first message on: `agentkv resume ID` continues it."""
"""What ``/help`` prints."""
INVALID_INPUT_NOTE = ("that line was not valid UTF-8: the bytes that could not be read were "
                      "replaced by \ufffd (U+FFFD) before it was sent")
COMMANDS = {"/quit": "quit", "/exit": "quit", "/help": "help", "/?": "help"}
_COMMAND = re.compile(r"(/?)(/[A-Za-z?]+)")
"""A line that is a command (``/word``), or one escaped to be sent as text (``//word``)."""


def chat_command(text: str) -> str | None:
    """"quit" or "help" for a command line, the line itself for an unknown ``/word``, None for a
    message (any other text, e.g. a path such as ``/etc/hosts is missing``, or ``//word``)."""
    found = _COMMAND.fullmatch(text)
    if found is None or found[1]:
        return None
    return COMMANDS.get(text.lower(), text)


def message_text(text: str) -> str:
    """The text a message line sends: ``//word`` (the escape for a command-like message) as ``/word``."""
    found = _COMMAND.fullmatch(text)
    return found[2] if found is not None and found[1] else text


def load_engine(model: str | None) -> Engine:
    """The engine the CLI chats on (one KV slot; ``AGENTKV_ENGINE`` picks paged or stateful,
    ``open_engine``'s default otherwise). Tests replace this with a scripted engine."""
    from agentkv.engine.factory import open_engine

    return open_engine(model, num_slots=1, kv_cache_bytes=256 << 20)


@dataclass(frozen=True)
class ChatRequest:
    """What ``agentkv chat`` / ``agentkv resume`` were asked to do."""

    conversation_id: str | None
    agent_name: str | None
    """``--agent``; None: the conversation's agent, or ``assistant`` for a new session."""
    options: AgentOptions
    model: str | None
    db: str | None
    metrics: bool


@dataclass
class Interrupts:
    """Turns SIGINTs into cancellations: the running turn's scope first, then the whole chat."""

    main: anyio.CancelScope | None = None
    """The chat's scope; cancelled to exit."""
    turn: anyio.CancelScope | None = None
    """The running turn's scope, if a turn is running."""
    exiting: bool = False
    _last: float = field(default=-math.inf)

    async def watch(self, signals: AsyncIterator[int]) -> None:
        """Consume SIGINTs until cancelled (also during clean-up, where they are absorbed)."""
        async for _ in signals:
            now = anyio.current_time()
            turn = self.turn
            if turn is not None and not turn.cancel_called and now - self._last >= DOUBLE_PRESS_S:
                turn.cancel()
            else:
                self.exiting = True
                if self.main is not None:
                    self.main.cancel()
            self._last = now


class LineReader:
    """Lines of stdin read ahead by a daemon thread: cancelling a read loses no line, and a read
    blocked on a terminal never delays the process's exit. Bytes that are not valid in the
    stream's encoding (UTF-8) become U+FFFD, so any input is text the model can read."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._send, self._receive = anyio.create_memory_object_stream[InputLine | None](math.inf)

    def start(self) -> None:
        """Start reading (call from the event loop)."""
        token = anyio.lowlevel.current_token()
        threading.Thread(target=self._pump, args=(token,), name="agentkv-stdin", daemon=True).start()

    def _pump(self, token: anyio.lowlevel.EventLoopToken) -> None:
        line: InputLine | None = None
        try:
            while (line := self._next_line()) is not None:
                anyio.from_thread.run_sync(self._send.send_nowait, line, token=token)
        except Exception:  # the loop has ended, or the stream was closed: nobody is reading
            line = None
        finally:
            if line is None:  # NOTE: end of input (or a failed read) must still end the chat
                try:
                    anyio.from_thread.run_sync(self._send.send_nowait, None, token=token)
                except Exception:
                    return

    def _next_line(self) -> InputLine | None:
        raw = getattr(self._stream, "buffer", None)
        if raw is None:  # a text stream without bytes underneath (already decoded)
            text = self._stream.readline()
            return InputLine(text, replaced=False) if text else None
        data = raw.readline()
        if not data:
            return None
        encoding = self._stream.encoding or "utf-8"
        try:
            return InputLine(data.decode(encoding), replaced=False)
        except UnicodeDecodeError:
            return InputLine(data.decode(encoding, errors="replace"), replaced=True)

    async def readline(self) -> InputLine | None:
        """The next line, or None at end of input."""
        return await self._receive.receive()


@dataclass(frozen=True)
class InputLine:
    """A line of input and whether bytes in it were invalid and replaced by U+FFFD."""

    text: str
    replaced: bool


async def run_chat(request: ChatRequest, out: Console, err: Console) -> int:
    """Run the chat to end of input (0, or 1 if a turn failed) or to a second Ctrl-C (130)."""
    interrupts = Interrupts()
    code = 0
    with anyio.open_signal_receiver(signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:
            tg.start_soon(interrupts.watch, signals)
            try:
                with anyio.CancelScope() as interrupts.main:
                    code = await _chat(request, interrupts, out, err)
            finally:
                tg.cancel_scope.cancel()
    if interrupts.exiting:
        # NOTE: the process is on its way out: later presses are ignored, also while the
        # interpreter shuts down (which would otherwise die of the default SIGINT action, -2).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        err.print()
        return EXIT_INTERRUPTED
    return code


async def _chat(request: ChatRequest, interrupts: Interrupts, out: Console, err: Console) -> int:
    store = open_store(request.db)
    engine: Engine | None = None
    runtime: Runtime | None = None
    try:
        agent, record = await _prepare(store, request, err)
        engine = load_engine(model_choice(request.model))
        check_window(agent, engine.max_context_len)
        runtime = Runtime(engine, store, agents=[agent])
        session = None
        if record is not None:
            session = await runtime.resume(record.id, agent)
            report = session.resume_report
            assert report is not None
            err.print(f"resumed conversation {record.id}: {report.messages} messages, "
                      f"{report.restored_tokens} tokens of KV restored from a snapshot")
        chat = _Chat(runtime, agent, session, request.metrics, out, err)
        return await chat.loop(interrupts)
    finally:
        with anyio.CancelScope(shield=True):
            if runtime is not None:
                await runtime.aclose()
            if engine is not None:  # the chat loaded it: its KV blocks and graphs go now, not at exit
                await engine.aclose()
            await store.close()


async def _prepare(store: Store, request: ChatRequest, err: Console) -> tuple[Agent, ConversationRecord | None]:
    """The agent (clashes refused before the model loads) and the conversation to resume, if any."""
    record = None
    name = request.agent_name or default_agent_name(request.options)
    if request.conversation_id is not None:
        record = await store.get_conversation(request.conversation_id)
        if request.agent_name is not None and request.agent_name != record.agent_name:
            raise CLIUsageError(
                f"conversation {record.id!r} runs the agent {record.agent_name!r}, not "
                f"{request.agent_name!r}; leave out --agent to continue it")
        name = record.agent_name
    agent, changes = await resolve_agent(store, name, request.options)
    if changes:
        err.print(f"[dim]agent {name!r} runs with {', '.join(changes)}[/dim]")
    return agent, record


@dataclass
class _Chat:
    """One chat's state: the runtime, the agent, and the conversation once the first line came."""

    runtime: Runtime
    agent: Agent
    session: Conversation | None
    metrics: bool
    out: Console
    err: Console
    failed: bool = False

    async def loop(self, interrupts: Interrupts) -> int:
        reader = LineReader(sys.stdin)
        reader.start()
        interactive = sys.stdin.isatty()
        self.err.print(f"[dim]{START_NOTE}[/dim]", highlight=False)
        while True:
            if interactive:
                self.out.print("[bold]you>[/bold] ", end="")
            line = await reader.readline()
            if line is None:
                break
            text = line.text.strip()
            if not text:
                continue
            if line.replaced:
                self.err.print(f"[yellow]{INVALID_INPUT_NOTE}[/yellow]", highlight=False)
            command = chat_command(text)
            if command == "quit":
                break
            if command is not None:
                self.err.print(HELP if command == "help" else f"unknown command {command}; /help lists "
                               "the commands (to send it as text, write it with a double slash: //word)",
                               markup=False, highlight=False)
                continue
            text = message_text(text)
            if self.session is None:
                self.session = await self.runtime.open_conversation(self.agent)
                self.err.print(f"conversation {self.session.id}")
            try:
                await self.turn(self.session, text, interrupts)
            finally:
                with anyio.CancelScope(shield=True):
                    await self._forget_if_empty()
        if interactive:
            self.out.print()
        return 1 if self.failed else 0

    async def _forget_if_empty(self) -> None:
        """Delete the conversation opened for this chat if its first turn stored nothing (a conversation
        row exists only once a message is stored), so the next line opens a new one."""
        session, store = self.session, self.runtime.store
        if session is None or store is None or session.window or await store.messages(session.id):
            return
        await self.runtime.close_conversation(session)
        await store.delete_conversation(session.id)
        self.session = None
        self.err.print(f"[dim]conversation {session.id} removed: its first turn stored nothing[/dim]",
                       highlight=False)

    async def turn(self, session: Conversation, text: str, interrupts: Interrupts) -> None:
        """Run one user turn; Ctrl-C cancels it and keeps what was streamed."""
        printer = TurnPrinter(self.out, self.err, metrics=self.metrics,
                              eos_token_id=self.runtime.engine.tokenizer.eos_token_id,
                              max_new_tokens=session.agent.generation.max_new_tokens)
        with anyio.CancelScope() as scope:
            interrupts.turn = scope
            try:
                async with aclosing(self.runtime.run_stream(session, text)) as events:
                    async for event in events:
                        printer.show(event)
            except AgentKVError as error:
                printer.end_line()
                self.err.print(f"[red]error:[/red] {error}", highlight=False)
                self.failed = True
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await keep_partial(session, printer.call_text)
                if not printer.finished:
                    printer.cancelled()
                raise
            finally:
                interrupts.turn = None


async def keep_partial(session: Conversation, text: str) -> None:
    """Record the streamed part of a cancelled answer as the assistant's turn, unless the run
    already recorded one (the window then ends with an assistant message)."""
    if not text.strip() or not session.window:
        return
    if session.window[-1].message.role in ("user", "tool"):
        await session.record(Message.assistant(text))
