"""Tools the model can call: ``@tool``, schemas from signatures, concurrent execution, built-ins.

::

    from agentkv.tools import tool, run_tool_calls, calculator, clock

    @tool
    def add(a: int, b: int) -> int:
        '''Add two integers.'''
        return a + b

    outcomes = await run_tool_calls([add, calculator, clock], message.tool_calls)
"""

from agentkv.tools.builtin import calculator, clock
from agentkv.tools.decorator import Tool, tool
from agentkv.tools.execution import ToolOutcome, run_tool_calls

__all__ = ["Tool", "ToolOutcome", "calculator", "clock", "run_tool_calls", "tool"]
