"""What one model call is asked for: the agent's generation settings capped to the room the
window leaves, and the grammar its tool calls (or typed answer) must follow::

    config = call_config(agent, conversation.context_len, len(prompt.token_ids))
    constraint = call_constraint(agent, conversation.engine, call_index)
"""

from __future__ import annotations

from agentkv.agent import Agent
from agentkv.chat.toolcalls import answer_grammar, tool_call_grammar
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


def call_constraint(agent: Agent, engine: Engine, call_index: int) -> TokenConstraint | None:
    """A grammar for tool calls (when the agent has tools and the engine supports grammars)
    whose answer, with an ``output_type``, is JSON under its schema (None: unconstrained):
    ``call_constraint(agent, engine, call_index=0)``."""
    output = agent.output_spec
    answer_schema = output.schema if output is not None else None
    tools_on = bool(agent.tools) and agent.tool_choice != "none"
    if tools_on and (agent.constrain_tool_calls or output is not None):
        # The forced choice applies to the first model call only; after tool results the model
        # must be free to answer (otherwise "required" could never finish).
        choice = agent.tool_choice if call_index == 0 else "auto"
        grammar = tool_call_grammar(agent.tool_schemas, choice, parallel=agent.parallel_tool_calls,
                                    answer_schema=answer_schema)
    elif answer_schema is not None:
        grammar = answer_grammar(answer_schema)
    else:
        return None
    return engine.make_constraint(grammar)
