"""Ready-made tools: ``calculator`` (safe arithmetic) and ``clock`` (the current date and time).

::

    agent = Agent(name="helper", instructions="...", tools=[calculator, clock])
    await calculator.invoke({"expression": "sqrt(2) ** 2"})    # "2.0000000000000004"
    await clock.invoke({"timezone": "Europe/Paris"})           # "2026-05-09T09:35:25+02:00"
"""

from __future__ import annotations

from datetime import datetime
from datetime import timezone as dt_timezone
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from agentkv.tools.arithmetic import Number, evaluate
from agentkv.tools.decorator import tool


@tool(timeout_s=5.0)
def calculator(expression: str) -> Number:
    """Evaluate an arithmetic expression exactly as written and return its value.

    Args:
        expression: The expression, e.g. "2 * (3 + 4) ** 2" or "sqrt(2) * sin(pi / 4)". Allowed:
            numbers, + - * / // % ** (power), parentheses, the constants pi, e, tau and the functions
            sqrt, exp, log, log10, log2, sin, cos, tan, asin, acos, atan, floor, ceil, abs, round,
            min, max.
    """
    return evaluate(expression)


@tool(timeout_s=5.0)
def clock(timezone: str | None = None) -> str:
    """Return the current date and time in ISO 8601 format.

    Args:
        timezone: An IANA time zone name such as "Europe/Paris" or "America/New_York";
            UTC when omitted.
    """
    return datetime.now(resolve_timezone(timezone)).isoformat(timespec="seconds")


def resolve_timezone(name: str | None) -> dt_timezone | ZoneInfo:
    """UTC for ``None`` or ``""``, else the IANA zone; ``ValueError`` names what to pass instead."""
    if name is None or not name.strip() or name.strip().upper() in ("UTC", "Z"):
        return dt_timezone.utc
    try:
        return ZoneInfo(name.strip())
    except (ZoneInfoNotFoundError, ValueError):
        raise ValueError(
            f"unknown time zone {name!r}; use an IANA name such as 'Europe/Paris' or "
            "'America/New_York', or omit it for UTC"
        ) from None
