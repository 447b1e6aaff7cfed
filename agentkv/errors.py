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


class PagedFormUnsupported(UserError):
    """The model has no PagedAttention form the paged engine can run (no ``[batch, heads, T, head_dim]``
    KV states, logits not from a MatMul): ``open_engine`` then uses the stateful engine."""


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


class ResponseSuperseded(AgentKVError):
    """The conversation went on past the response a request continues (another request, maybe
    on another replica, continued it first): nothing was run or rewound. Continue from the newest
    response (``newer_response_id``), or start a new conversation."""

    def __init__(self, conversation_id: str, newer_response_id: str) -> None:
        super().__init__(
            f"conversation {conversation_id!r} went on past the response this request continues: response "
            f"{newer_response_id!r} followed it; continue from that one (or the newest), or start a new "
            "conversation with the history as input"
        )
        self.conversation_id = conversation_id
        self.newer_response_id = newer_response_id


class KVSessionClosed(UserError):
    """An operation was attempted on a KV session that has been closed (``KVSession.close``)."""


class ConversationExists(UserError):
    """A new conversation was asked for under an id a stored conversation already has (perhaps created a
    moment before by another process): pass another id, or none to get a fresh one."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(f"conversation {conversation_id!r} already exists; pass another id or none")
        self.conversation_id = conversation_id


class ConversationNotFound(AgentKVError):
    """No conversation with this id exists in the store."""

    def __init__(self, conversation_id: str) -> None:
        super().__init__(
            f"no conversation {conversation_id!r} in the store; list them with `agentkv conversations list`"
        )
        self.conversation_id = conversation_id


class ConversationBusy(AgentKVError):
    """The conversation is being run by another task or process; retry when it finishes."""

    def __init__(self, conversation_id: str, holder: str | None = None, *, action: str | None = None) -> None:
        who = f" (held by {holder})" if holder else ""
        if action is None:
            message = (f"conversation {conversation_id!r} is already running{who}; wait for that run to end, "
                       "or open a new conversation")
        else:  # a change of the history (rewind, fork, delete) refused while a run is live
            message = (f"cannot {action} conversation {conversation_id!r}: a run is live in it{who}; retry once "
                       "that run ends, or stop it first (a holder on a host that crashed: "
                       "`agentkv conversations unlock`)")
        super().__init__(message)
        self.conversation_id = conversation_id
        self.holder = holder
        self.action = action
        """What was refused (``"rewind"``, ``"fork"``, ``"delete"``), None for a run."""


class SnapshotCorrupt(AgentKVError):
    """A KV snapshot file is damaged (checksum mismatch, truncated, unreadable)."""


class SnapshotIncompatible(AgentKVError):
    """A KV snapshot was made by another model or KV layout and cannot be restored here."""


class MaxModelCallsExceeded(AgentKVError):
    """An agent run used more model calls than ``Agent.max_model_calls`` allows."""

    def __init__(self, max_model_calls: int, result: Any = None) -> None:
        super().__init__(
            f"the run exceeded max_model_calls={max_model_calls}; raise Agent.max_model_calls or make the "
            "tools return what the model needs sooner"
        )
        self.max_model_calls = max_model_calls
        self.result = result
        """The run so far (a ``RunResult`` with ``finish_reason="max_model_calls"``), when known."""


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


class KVPoolExhausted(AgentKVError):
    """Not enough free KV blocks even after the pool's ``reclaim`` hook ran (the paged engine lets
    cached prefixes go and offloads idle sessions to host): shorten prompts, close sessions that
    are running, or give the engine more ``kv_cache_bytes``."""


class KVPoolCorrupt(AgentKVError):
    """A paged engine's block pool broke its own bookkeeping (a block both free and held, or on
    the free list twice): a bug in agentkv, report it with the operations that led there."""

    def __init__(self, message: str, *, block: int | None = None) -> None:
        super().__init__(message)
        self.block = block
        """The first block found inconsistent (None: the free list itself)."""


class KVLogCorrupt(AgentKVError):
    """The slot holds a different number of positions than the log has tokens (a bug: report it)."""


class UnknownStateLayout(AgentKVError):
    """The model's variable states do not follow the ``past_key_values.N.key|value`` naming."""


class ModelCompileFailed(AgentKVError):
    """OpenVINO could not compile the model for a reason other than the device (the message
    carries OpenVINO's own cause: an unsupported property, a broken model file, ...)."""

    def __init__(self, message: str, *, device: str, cause: str) -> None:
        super().__init__(message)
        self.device = device
        self.cause = cause
        """OpenVINO's first line that says what went wrong."""


class ToolResultNotText(UserError):
    """A tool returned a value that cannot be turned into the text the model reads (e.g. bytes
    that are not UTF-8): return ``str`` or JSON-able values (encode binary data, e.g. base64)."""

    def __init__(self, message: str, *, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name
        """The type of the value that could not be serialised."""


class StoreUnavailable(AgentKVError):
    """The database could not be read or written: read-only, disk full, an I/O error, a server
    that cannot be reached. The message names the database and what to do."""

    def __init__(self, url: str, cause: BaseException) -> None:
        text = str(getattr(cause, "orig", None) or cause).strip()
        reason = text.splitlines()[0] if text else type(cause).__name__
        super().__init__(f"the database {url} failed: {reason}; {_store_hint(reason)}")
        self.url = url
        """The database URL (password hidden)."""
        self.cause = reason
        """The database driver's own first line (e.g. "attempt to write a readonly database")."""


def _store_hint(reason: str) -> str:
    """What to do about a database failure, from the driver's message."""
    text = reason.lower()
    if "readonly" in text or "read-only" in text or "permission" in text:
        return ("make the database file and its directory writable by this user, or pass another "
                "--db / AGENTKV_DB_URL")
    if "full" in text or "i/o error" in text or "no space" in text:
        return "free space on the database's disk (and check the disk), then retry"
    if "unable to open" in text:
        return ("check that the database file and its directory exist and are writable by this user, or pass "
                "another --db / AGENTKV_DB_URL")
    return "check that the database is reachable and writable, or pass another --db / AGENTKV_DB_URL"


class LeaseLost(AgentKVError):
    """This run's lease of a conversation was taken by another holder (an operator's ``conversations unlock
    --force``, or a stall past the lease's ttl): it stopped before writing, so the new holder's
    history stays valid. Resume the conversation to continue from what is stored."""

    def __init__(self, conversation_id: str, holder: str | None) -> None:
        who = f" by {holder}" if holder else ""
        super().__init__(
            f"this run lost the lease of conversation {conversation_id!r} (taken{who}); it stopped without "
            "writing more; resume the conversation to continue from what is stored"
        )
        self.conversation_id = conversation_id
        self.holder = holder
        """Who holds the lease now (None: nobody, it was released)."""
