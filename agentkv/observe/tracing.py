"""OpenTelemetry spans for runs, model calls, tool calls, compactions and snapshot saves and
restores — a no-op when ``opentelemetry-api`` is not installed (``pip install agentkv[tracing]``).

Spans go to the global tracer provider, or to the one given here::

    from opentelemetry.sdk.trace import TracerProvider
    agentkv.observe.tracing.use_tracer_provider(TracerProvider())      # else opentelemetry's global one

Spans are started and ended explicitly with their parent named (never made "current"): runs are
async generators, and a context attached in one and detached after a ``yield`` would leak.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

try:
    from opentelemetry import trace as _trace
except ImportError:  # NOTE: an optional dependency: every span below is then a no-op
    _trace = None  # type: ignore[assignment]

TRACER_NAME = "agentkv"
_provider: Any = None


def use_tracer_provider(provider: Any) -> None:
    """Send agentkv's spans to ``provider`` (None: back to opentelemetry's global one)."""
    global _provider
    _provider = provider


def enabled() -> bool:
    """True when opentelemetry is installed (spans are recorded if a provider takes them)."""
    return _trace is not None


class Span:
    """A started span (or nothing, without opentelemetry): set attributes, then ``end``."""

    def __init__(self, real: Any = None) -> None:
        self.real = real

    def set(self, **attributes: Any) -> None:
        if self.real is not None:
            self.real.set_attributes(_clean(attributes))

    def fail(self, error: BaseException) -> None:
        if self.real is not None and _trace is not None:  # a real span exists only with opentelemetry
            self.real.record_exception(error)
            self.real.set_status(_trace.Status(_trace.StatusCode.ERROR, str(error)))

    def end(self, end_s: float | None = None) -> None:
        if self.real is not None:
            self.real.end(end_time=None if end_s is None else int(end_s * 1e9))


NO_SPAN = Span()


def start(name: str, parent: Span | None = None, *, start_s: float | None = None, **attributes: Any) -> Span:
    """A span named ``name`` under ``parent`` (a root span without one); ``start_s``: when it
    began (``time.time()``), for work timed elsewhere."""
    if _trace is None:
        return NO_SPAN
    tracer = _trace.get_tracer(TRACER_NAME, tracer_provider=_provider)
    context = _trace.set_span_in_context(parent.real) if parent is not None and parent.real is not None else None
    real = tracer.start_span(name, context=context, attributes=_clean(attributes),
                             start_time=None if start_s is None else int(start_s * 1e9))
    return Span(real)


@contextmanager
def span(name: str, parent: Span | None = None, **attributes: Any) -> Iterator[Span]:
    """``start`` … ``end`` around a block (an exception marks the span failed, then propagates)."""
    opened = start(name, parent, **attributes)
    try:
        yield opened
    except BaseException as error:
        opened.fail(error)
        raise
    finally:
        opened.end()


def finished(name: str, parent: Span | None, seconds: float, **attributes: Any) -> None:
    """A span for work that took ``seconds`` and just ended (a tool call, a compaction)."""
    now = time.time()
    start(name, parent, start_s=now - max(seconds, 0.0), **attributes).end(now)


def _clean(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """Attributes as opentelemetry takes them: None dropped, other objects as text."""
    return {key: value if isinstance(value, (bool, int, float, str)) else str(value)
            for key, value in attributes.items() if value is not None}
