"""A clock that moves only when told, for lease tests that must not sleep waiting for a TTL.

::

    clock = FakeClock()
    store = Store(url, clock=clock)
    await store.acquire_lease(sid, "worker-a", ttl_s=30)
    clock.advance(31)                        # the lease has now expired, without waiting
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

__all__ = ["FakeClock"]


class FakeClock:
    """A callable returning a fixed, timezone-aware UTC time that ``advance`` moves forward.

    Pass it where a clock is taken (``Store(clock=FakeClock())``).
    """

    def __init__(self, start: datetime | None = None) -> None:
        if start is not None and start.tzinfo is None:
            raise ValueError("FakeClock needs a timezone-aware start time")
        self.now = start or datetime.now(timezone.utc)
        """The time the clock reads until it is advanced."""

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        """Move the clock forward by ``seconds`` (``clock.advance(31)``)."""
        if seconds < 0:
            raise ValueError(f"a clock only moves forward, got {seconds}")
        self.now += timedelta(seconds=seconds)
