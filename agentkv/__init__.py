"""agentkv: an async agent runtime whose conversations keep their KV cache alive.

::

    from agentkv import Agent, Runtime, open_engine, tool

    engine = open_engine()                     # the default offline model, paged engine on CPU
    runtime = Runtime(engine)
    conversation = await runtime.open_conversation(Agent(name="helper"))
    result = await runtime.run(conversation, "Hello!")

Importing agentkv does not load a model: the engines (and OpenVINO) load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from agentkv.agent import Agent
from agentkv.chat.messages import Message, ToolCall
from agentkv.chat.openai_messages import messages_from_openai
from agentkv.engine.base import Engine, GenerationConfig, KVSession
from agentkv.engine.generation import GenerationMetrics, GenerationResult, GenerationStream, TokenLogprob, TopLogprob
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
    PagedFormUnsupported,
    ResponseNotFound,
    ResponseSuperseded,
    ConversationBusy,
    KVSessionClosed,
    ConversationExists,
    ConversationNotFound,
    SnapshotCorrupt,
    SnapshotIncompatible,
    StoreUnavailable,
    ToolResultNotText,
    UnknownStateLayout,
    UserError,
)
from agentkv.events import (
    ApprovalRequired,
    CacheBroken,
    ContextCompacted,
    ModelCallFinished,
    ReasoningDelta,
    RunEvent,
    RunFinished,
    SelfCheckFailed,
    TextDelta,
    ToolCalled,
    ToolReturned,
)
from agentkv.kv.snapshot import KVSnapshot
from agentkv.observe.cache_breaks import CacheBreak
from agentkv.result import RunResult
from agentkv.run.approvals import Decisions
from agentkv.run.conversation import Conversation
from agentkv.run.input import RunInput
from agentkv.runtime.runtime import Runtime
from agentkv.tools import Tool, ToolOutcome, calculator, clock, run_tool_calls, tool

if TYPE_CHECKING:
    from agentkv.engine.factory import open_engine
    from agentkv.engine.paged.engine import PagedEngine
    from agentkv.engine.stateful.engine import StatefulEngine

__all__ = [
    "Agent", "AgentKVError", "ApprovalRequired", "CacheBreak", "CacheBroken", "ConstraintError",
    "ContextCompacted", "ContextOverflowError", "Conversation", "Decisions", "Engine",
    "GenerationConfig", "GenerationMetrics", "GenerationResult", "GenerationStream", "KVLogCorrupt",
    "KVPoolCorrupt", "KVPoolExhausted", "KVSession", "KVSnapshot", "LeaseLost",
    "MaxModelCallsExceeded", "Message", "ModelCallFinished", "ModelCompileFailed", "ModelNotFound",
    "PagedEngine", "PagedFormUnsupported", "ReasoningDelta", "ResponseNotFound", "ResponseSuperseded",
    "ConversationExists", "RunEvent", "RunFinished", "RunInput", "RunResult",
    "Runtime", "SelfCheckFailed", "ConversationBusy", "KVSessionClosed", "ConversationNotFound",
    "SnapshotCorrupt", "SnapshotIncompatible", "StatefulEngine", "StoreUnavailable", "TextDelta",
    "TokenLogprob", "Tool", "ToolCall", "ToolCalled", "ToolOutcome", "ToolResultNotText",
    "ToolReturned", "TopLogprob", "UnknownStateLayout", "UserError", "calculator", "clock",
    "messages_from_openai", "open_engine", "run_tool_calls", "tool",
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
