"""agentkv: an async agent runtime whose conversations keep their KV cache alive.

::

    from agentkv import Agent, Runtime, open_engine, tool

    engine = open_engine()                     # the default offline model, paged engine on CPU
    runtime = Runtime(engine)
    session = await runtime.open_conversation(Agent(name="helper"))
    result = await runtime.run(session, "Hello!")

Importing agentkv does not load a model: the engines (and OpenVINO) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.agent import Agent
from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.run.conversation import Conversation
from agentkv.engine.base import (
    Engine,
    GenerationConfig,
    GenerationMetrics,
    GenerationResult,
    GenerationStream,
    KVSession,
)
from agentkv.kv.snapshot import KVSnapshot
from agentkv.errors import (
    AgentKVError,
    ConstraintError,
    ContextOverflowError,
    KVLogCorrupt,
    KVPoolCorrupt,
    KVPoolExhausted,
    LeaseLost,
    MaxModelCallsExceeded,
    ModelCompileFailed,
    ModelNotFound,
    ResponseNotFound,
    SessionBusy,
    SessionClosed,
    SessionNotFound,
    SnapshotCorrupt,
    SnapshotIncompatible,
    StoreUnavailable,
    ToolResultNotText,
    UnknownStateLayout,
    UserError,
)
from agentkv.engine.base import TokenLogprob, TopLogprob
from agentkv.observe.cache_breaks import CacheBreak
from agentkv.events import (
    ApprovalRequired,
    CacheBroken,
    ContextCompacted,
    RunEvent,
    RunFinished,
    TextDelta,
    ToolCalled,
    ToolReturned,
    ModelCallFinished,
)
from agentkv.run.approvals import Decisions
from agentkv.result import RunResult
from agentkv.run.input import RunInput
from agentkv.runtime.runtime import Runtime
from agentkv.tools import Tool, ToolOutcome, calculator, clock, run_tool_calls, tool

if TYPE_CHECKING:
    from agentkv.engine.factory import open_engine
    from agentkv.engine.paged.engine import PagedEngine
    from agentkv.engine.stateful.engine import StatefulEngine

__all__ = [
    "Agent", "AgentKVError", "ApprovalRequired", "CacheBreak", "CacheBroken", "ConstraintError", "ContextCompacted", "ContextOverflowError", "Conversation",
    "Decisions", "Engine", "GenerationConfig", "GenerationMetrics", "GenerationResult", "GenerationStream", "KVSession",
    "KVSnapshot", "MaxModelCallsExceeded", "Message", "ModelNotFound", "PagedEngine", "RunEvent", "RunFinished",
    "RunInput", "RunResult", "Runtime", "ResponseNotFound", "SessionBusy", "SessionClosed", "SessionNotFound", "SnapshotCorrupt",
    "SnapshotIncompatible", "StatefulEngine", "open_engine", "ModelCallFinished", "TextDelta", "Tool", "ToolCall", "ToolCalled",
    "ToolOutcome", "ToolReturned", "UserError", "calculator", "clock", "messages_from_openai", "run_tool_calls",
    "tool",
    "KVLogCorrupt", "KVPoolCorrupt", "KVPoolExhausted", "ModelCompileFailed", "ToolResultNotText",
    "UnknownStateLayout",
    "LeaseLost", "StoreUnavailable",
    "TokenLogprob", "TopLogprob",
]


def __getattr__(name: str) -> Any:
    # The engines import OpenVINO: load them only when asked for.
    if name == "StatefulEngine":
        from agentkv.engine.stateful.engine import StatefulEngine

        return StatefulEngine
    if name == "PagedEngine":
        from agentkv.engine.paged.engine import PagedEngine

        return PagedEngine
    if name == "open_engine":
        from agentkv.engine.factory import open_engine

        return open_engine
    raise AttributeError(f"module 'agentkv' has no attribute {name!r}")
