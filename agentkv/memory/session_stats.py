"""SessionStats: what a stored session's KV is and has saved — tokens, KV bytes, snapshots, the
tokens every model call reused against those it computed, the time that saved, and the
compactions and cache breaks so far (``agentkv sessions show ID --kv``)::

    stats = await session_stats(store, session_id)
    print(stats.reused_tokens, stats.saved_s, stats.cache_breaks)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from agentkv.memory import SnapshotRecord, Store
from agentkv.memory.schema import utcnow


@dataclass(frozen=True)
class SessionStats:
    """A stored session's KV figures (all from the store: no model needed)."""

    session_id: str
    window_tokens: int
    """Tokens of the messages in the window (what the next prompt renders, roughly)."""
    kv_tokens: int
    """Tokens the KV held after the last model call."""
    kv_bytes: int
    snapshots: tuple[SnapshotRecord, ...]
    calls: int
    reused_tokens: int
    """Prompt tokens not computed, over every call: held by the session or from the prefix cache."""
    prefilled_tokens: int
    generated_tokens: int
    prefill_s_per_token: float
    """Mean time to first token per prefilled token, over the session's calls."""
    compactions: int
    cache_breaks: tuple[str, ...]
    """One line per call that reused less than its session held, oldest first."""

    @property
    def saved_s(self) -> float:
        """The prefill the reused tokens would have cost at this session's own rate."""
        return self.reused_tokens * self.prefill_s_per_token

    def lines(self, now: datetime | None = None) -> list[str]:
        """The figures as lines of text."""
        now = now or utcnow()
        out = [
            f"window {self.window_tokens} tokens; KV {self.kv_tokens} tokens, {self.kv_bytes / 1e6:.1f} MB",
            f"{self.calls} model calls: reused {self.reused_tokens} tokens, prefilled {self.prefilled_tokens}, "
            f"generated {self.generated_tokens}; reuse saved ~{self.saved_s:.2f} s "
            f"({self.prefill_s_per_token * 1000:.2f} ms per prefilled token)",
            f"{self.compactions} compactions, {len(self.cache_breaks)} cache breaks",
        ]
        out += [f"  {line}" for line in self.cache_breaks[-5:]]
        for snap in self.snapshots:
            age = (now - snap.created_at).total_seconds()
            out.append(f"snapshot {snap.num_tokens} tokens, {snap.nbytes / 1e6:.1f} MB, {snap.precision}, "
                       f"{_age(age)} old")
        return out


async def session_stats(store: Store, session_id: str) -> SessionStats:
    """The figures of a stored session (``SessionNotFound`` for an unknown id)."""
    messages = await store.messages(session_id, in_window_only=True)
    calls = await store.calls(session_id)
    last = calls[-1] if calls else None
    prefilled = sum(c.prefilled_tokens for c in calls)
    ttft = sum(c.ttft_s for c in calls if c.prefilled_tokens)
    return SessionStats(
        session_id=session_id,
        window_tokens=sum(m.token_count for m in messages),
        kv_tokens=last.kv_tokens if last else 0,
        kv_bytes=last.kv_bytes if last else 0,
        snapshots=tuple(await store.snapshots(session_id)),
        calls=len(calls),
        reused_tokens=sum(c.reused_tokens + c.prefix_cache_tokens for c in calls),
        prefilled_tokens=prefilled,
        generated_tokens=sum(c.generated_tokens for c in calls),
        prefill_s_per_token=ttft / prefilled if prefilled else 0.0,
        compactions=sum(1 for c in calls if c.compaction),
        cache_breaks=tuple(str(c.cache_break.get("summary", c.cache_break)) for c in calls if c.cache_break),
    )


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
