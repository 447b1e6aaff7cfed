"""The exceptions agentkv raises: one root, subclasses that name what happened.

Every message says what to do next. Catch ``AgentKVError`` for all of them::

    try:
        await session.generate(ids, cfg)
    except ContextOverflowError as e:
        print(e.prompt_tokens, e.limit)
"""

from __future__ import annotations

from typing import Any


class AgentKVError(Exception):
    """Root of every error agentkv raises on purpose."""


class UserError(AgentKVError):
    """The library was used in a way it does not support (a bug in the caller)."""


class ModelNotFound(AgentKVError):
    """No model could be found at the given path (or the default model is not installed)."""


class ContextOverflowError(AgentKVError):
    """A prompt does not fit the model's context window (or the agent's ``max_prompt_len``)."""

    def __init__(self, message: str, *, prompt_tokens: int, limit: int) -> None:
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class ResponseNotFound(AgentKVError):
    """No stored response has this id (for the caller: another tenant's is not found either)."""

    def __init__(self, response_id: str) -> None:
        super().__init__(
            f"no stored response {response_id!r}: it was never stored (store=false), was deleted, "
            "or belongs to another API key; start a new conversation without previous_response_id"
        )
        self.response_id = response_id


class SessionClosed(UserError):
    """An operation was attempted on a session that has been closed."""


class SessionNotFound(AgentKVError):
    """No session with this id exists in the store."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"no session {session_id!r} in the store; list sessions with `agentkv sessions list`"
        )
        self.session_id = session_id


class SessionBusy(AgentKVError):
    """The session is being run by another task or process; retry when it finishes."""

    def __init__(self, session_id: str, holder: str | None = None) -> None:
        who = f" (held by {holder})" if holder else ""
        super().__init__(
            f"session {session_id!r} is already running{who}; wait for that run to end, "
            "or open a new session"
        )
        self.session_id = session_id
        self.holder = holder


class SnapshotCorrupt(AgentKVError):
    """A KV snapshot file is damaged (checksum mismatch, truncated, unreadable)."""


class SnapshotIncompatible(AgentKVError):
    """A KV snapshot was made by another model or KV layout and cannot be restored here."""


class MaxTurnsExceeded(AgentKVError):
    """An agent run used more model turns than ``Agent.max_turns`` allows."""

    def __init__(self, max_turns: int, result: Any = None) -> None:
        super().__init__(
            f"the run exceeded max_turns={max_turns}; raise Agent.max_turns or make the "
            "tools return what the model needs sooner"
        )
        self.max_turns = max_turns
        self.result = result
        """The run so far (a ``RunResult`` with ``finish_reason="max_turns"``), when known."""


class ConstraintError(AgentKVError):
    """Grammar-constrained decoding could not be set up or reached a dead end."""


class SchemaVersionError(AgentKVError):
    """The database was written by a newer agentkv schema than this one understands."""


class AgentNotFound(AgentKVError):
    """No agent with this name is stored; ``upsert_agent`` it first."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"no agent {name!r} in the store; store it with upsert_agent (Runtime does this "
            "when it opens a session for the agent)"
        )
        self.name = name


class StoreLocked(AgentKVError):
    """The database stayed locked by another writer through every bounded retry."""


class KVShiftUnsupported(AgentKVError):
    """A session cannot drop a span from its KV by RoPE shift (no rotation fits the model's keys,
    or the engine has no KV-level drop); drop the messages and re-prefill instead
    (``policies.Truncation``)."""
