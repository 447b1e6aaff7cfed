"""Context-window policies: what leaves the window when a conversation reaches ``max_prompt_len``.

::

    from agentkv.policies import SlidingWindow, SummarizeAndReprefill, Truncation

    agent = Agent(name="chat", policy=SlidingWindow(low_water=0.7), max_prompt_len=1024)

A policy sees its conversation only through ``ConversationView`` (``agentkv.policies.protocol``): write
your own by implementing ``ContextPolicy.compact`` against it.
"""

from agentkv.policies.base import WindowPolicy, low_water_tokens
from agentkv.policies.protocol import ContextPolicy, ConversationView, PolicyAgent, WindowItem
from agentkv.policies.selection import RemovalPlan, Unit, group_units, plan_removal
from agentkv.policies.sliding_window import SlidingWindow
from agentkv.policies.summarize import SummarizeAndReprefill
from agentkv.policies.summary_prompt import SUMMARY_PREFIX
from agentkv.policies.truncation import Truncation

__all__ = [
    "SUMMARY_PREFIX",
    "ContextPolicy",
    "ConversationView",
    "PolicyAgent",
    "RemovalPlan",
    "SlidingWindow",
    "SummarizeAndReprefill",
    "Truncation",
    "Unit",
    "WindowItem",
    "WindowPolicy",
    "group_units",
    "low_water_tokens",
    "plan_removal",
]
