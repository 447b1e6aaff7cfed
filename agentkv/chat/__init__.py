"""Chat messages and their rendering to token ids: ``ChatRenderer(tok).render([Message.user("hi")])``."""

from agentkv.chat.messages import Message, Role, ToolCall, new_call_id
from agentkv.chat.render import (
    ChatRenderer,
    MessageSpan,
    RenderedPrompt,
    default_tools_text,
)

__all__ = [
    "ChatRenderer",
    "Message",
    "MessageSpan",
    "RenderedPrompt",
    "Role",
    "ToolCall",
    "default_tools_text",
    "new_call_id",
]
