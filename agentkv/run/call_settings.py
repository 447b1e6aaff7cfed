"""What one model call is asked for: the agent's generation settings capped to the room the
window leaves, and the grammar its tool calls (or typed answer) must follow::

    config = call_config(agent, conversation.context_len, len(prompt.token_ids))
    constraint = call_constraint(agent, conversation.engine, call_index,
                                 tool_format=tool_format_of(conversation.renderer),
                                 reasoning_tags=reasoning_tags_of(conversation.renderer),
                                 reasoning_ids=reasoning_ids_of(conversation.renderer))
"""

from __future__ import annotations

from agentkv.agent import Agent
from agentkv.chat.reasoning import ReasoningTags, ThinkingBudget, with_reasoning
from agentkv.chat.tool_formats import HERMES, ToolCallFormat
from agentkv.chat.toolcalls import answer_grammar
from agentkv.engine.base import Engine, GenerationConfig, TokenConstraint


def room(agent: Agent, context_len: int, prompt_len: int) -> int:
    """Tokens the window leaves for an answer after a prompt of ``prompt_len``:
    ``room(agent, 4096, 3000)``."""
    return max(1, agent.max_prompt(context_len) - prompt_len)


def call_config(agent: Agent, context_len: int, prompt_len: int) -> GenerationConfig:
    """The agent's config, with max_new_tokens capped to what the window leaves:
    ``call_config(agent, 4096, 3000).max_new_tokens``."""
    left = room(agent, context_len, prompt_len)
    if agent.generation.max_new_tokens <= left:
        return agent.generation
    return agent.generation.model_copy(update={"max_new_tokens": left})


def tool_format_of(renderer: object) -> ToolCallFormat:
    """The tool-call format a conversation's renderer detected for its model (Hermes when it
    names none): ``tool_format_of(conversation.renderer).name``."""
    found = getattr(renderer, "tool_format", HERMES)
    return found if isinstance(found, ToolCallFormat) else HERMES


def reasoning_tags_of(renderer: object) -> ReasoningTags | None:
    """The thinking tags of a conversation's model (``ChatRenderer.reasoning_tags``; None: it
    does not reason): ``reasoning_tags_of(conversation.renderer)``."""
    found = getattr(renderer, "reasoning_tags", None)
    return (found[0], found[1]) if isinstance(found, tuple) and len(found) == 2 else None


def reasoning_ids_of(renderer: object) -> tuple[int, int] | None:
    """The ids of those tags when each is one token (``ChatRenderer.reasoning_ids``):
    ``reasoning_ids_of(conversation.renderer)``."""
    found = getattr(renderer, "reasoning_ids", None)
    return (int(found[0]), int(found[1])) if isinstance(found, tuple) and len(found) == 2 else None


def call_constraint(agent: Agent, engine: Engine, call_index: int, *,
                    tool_format: ToolCallFormat = HERMES,
                    reasoning_tags: ReasoningTags | None = None,
                    reasoning_ids: tuple[int, int] | None = None) -> TokenConstraint | None:
    """A grammar for tool calls in ``tool_format`` (when the agent has tools and the engine
    supports grammars) whose answer, with an ``output_type``, is JSON under its schema (None:
    unconstrained); with ``reasoning_tags`` one thinking block of at most half of
    ``max_new_tokens`` may come first (``with_reasoning``):
    ``call_constraint(agent, engine, call_index=0, tool_format=HERMES)``."""
    output = agent.output_spec
    answer_schema = output.schema if output is not None else None
    tools_on = bool(agent.tools) and agent.tool_choice != "none"
    if tools_on and (agent.constrain_tool_calls or output is not None):
        # The forced choice applies to the first model call only; after tool results the model
        # must be free to answer (otherwise "required" could never finish).
        choice = agent.tool_choice if call_index == 0 else "auto"
        grammar = tool_format.grammar(agent.tool_schemas, choice, parallel=agent.parallel_tool_calls,
                                      answer_schema=answer_schema)
    elif answer_schema is not None:
        grammar = answer_grammar(answer_schema)
    else:
        return None
    tag_ids = reasoning_ids if reasoning_tags is not None else None
    constraint = engine.make_constraint(with_reasoning(grammar, reasoning_tags, tag_ids=tag_ids))
    if constraint is None or tag_ids is None:
        return constraint
    # NOTE: thinking may take half of the call's tokens: the answer (a forced call) needs the rest
    return ThinkingBudget(constraint, *tag_ids, max_tokens=max(1, agent.generation.max_new_tokens // 2))
