"""ConversationStats: what a stored conversation's KV is and has saved — tokens, KV bytes, snapshots, the
tokens every model call reused against those it computed, the time that saved, the compactions
and cache breaks so far, and what grammar fast-forward and prompt-lookup drafts did in each call
(``agentkv conversations show ID --kv``)::

    stats = await conversation_stats(store, conversation_id)
    print(stats.reused_tokens, stats.saved_s, stats.cache_breaks)
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from agentkv.memory import CallRecord, SnapshotRecord, Store
from agentkv.memory.schema import utcnow


@dataclass(frozen=True)
class CallDecode:
    """One model call's decode figures: ``CallDecode(4, generated=40, forced=24).line()``."""

    number: int
    """The call's place among the conversation's recorded calls, from 1."""
    generated: int
    """Tokens the call generated (``CallRecord.generated_tokens``)."""
    forced: int = 0
    """Of those, tokens a grammar forced, taken without sampling (``CallRecord.forced_tokens``)."""
    drafted: int = 0
    """Draft tokens prompt lookup proposed for the model to check (``CallRecord.drafted_tokens``)."""
    accepted: int = 0
    """Drafted tokens the model's own choice confirmed (``CallRecord.accepted_tokens``)."""
    steps_saved: int = 0
    """Model steps saved against one step per token: forced runs fed as one chunk, plus
    confirmed drafted tokens (``CallRecord.steps_saved``)."""

    @property
    def active(self) -> bool:
        """True when the call forced or drafted a token."""
        return bool(self.forced or self.drafted or self.steps_saved)

    def line(self) -> str:
        """``call 4: generated 40, forced 24, drafted 10, accepted 8, 26 steps saved``."""
        return (f"call {self.number}: generated {self.generated}, forced {self.forced}, drafted {self.drafted}, "
                f"accepted {self.accepted}, {self.steps_saved} steps saved")

    @classmethod
    def of(cls, number: int, call: CallRecord) -> CallDecode | None:
        """The figures of ``call`` (None when it was recorded before schema 9 kept them)."""
        if call.forced_tokens is None:
            return None
        return cls(number, call.generated_tokens, call.forced_tokens, call.drafted_tokens or 0,
                   call.accepted_tokens or 0, call.steps_saved or 0)


@dataclass(frozen=True)
class ConversationStats:
    """A stored conversation's KV figures (all from the store: no model needed)."""

    conversation_id: str
    """The conversation the figures are of."""
    window_tokens: int
    """Sum of ``token_count`` over the messages in the window (what the next prompt renders,
    roughly: the system prompt and tool schemas are not counted)."""
    kv_tokens: int
    """Tokens the KV held after the last recorded model call (0 before any call)."""
    kv_bytes: int
    """Bytes that KV occupied in the model's cache precision (0 before any call)."""
    snapshots: tuple[SnapshotRecord, ...]
    """The conversation's stored KV snapshots, newest first."""
    calls: int
    """Model calls recorded for the conversation (one per ``ModelCallFinished`` of its stored runs)."""
    reused_tokens: int
    """Prompt tokens not computed, over every call: held by the conversation or from the prefix cache."""
    prefilled_tokens: int
    """Prompt tokens run through the model, over every call."""
    generated_tokens: int
    """Tokens generated, over every call."""
    prefill_s_per_token: float
    """Seconds of time to first token per prefilled token: the ``ttft_s`` of the calls that
    prefilled anything, summed, over their prefilled tokens (0.0 when no call prefilled)."""
    compactions: int
    """Model calls that came right after a context compaction."""
    cache_breaks: tuple[str, ...]
    """One line per call that reused less than its conversation held (``CacheBreak.describe()``),
    oldest first."""
    decode: tuple[CallDecode, ...] = ()
    """What fast-forward and drafts did in each call that recorded it (schema 9 on), oldest first."""

    @property
    def forced_tokens(self) -> int:
        """Generated tokens a grammar forced, over the calls in ``decode``."""
        return sum(d.forced for d in self.decode)

    @property
    def drafted_tokens(self) -> int:
        """Tokens prompt-lookup drafts proposed, over the calls in ``decode``."""
        return sum(d.drafted for d in self.decode)

    @property
    def accepted_tokens(self) -> int:
        """Drafted tokens the model confirmed, over the calls in ``decode``."""
        return sum(d.accepted for d in self.decode)

    @property
    def steps_saved(self) -> int:
        """Model steps grammar fast-forward saved, over the calls in ``decode`` (drafts: fewer model steps)."""
        return sum(d.steps_saved for d in self.decode)

    @property
    def saved_s(self) -> float:
        """The prefill the reused tokens would have cost at this conversation's own rate."""
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
        out += self._decode_lines()
        for snap in self.snapshots:
            age = (now - snap.created_at).total_seconds()
            where = (f"{len(snap.block_keys)} shared blocks of {snap.block_size} tokens + a tail file of "
                     f"{snap.nbytes / 1e6:.1f} MB" if snap.block_keys else f"{snap.nbytes / 1e6:.1f} MB")
            out.append(f"snapshot {snap.num_tokens} tokens, {where}, {snap.precision}, {_age(age)} old")
        return out

    def _decode_lines(self) -> list[str]:
        """The fast-forward and draft totals, then the own figures of the last five calls that
        forced or drafted anything."""
        if not self.decode:
            return []
        generated = sum(d.generated for d in self.decode)
        share = f" ({self.accepted_tokens / self.drafted_tokens:.0%})" if self.drafted_tokens else ""
        unrecorded = self.calls - len(self.decode)
        out = [f"decode: {self.forced_tokens} of {generated} generated tokens forced, {self.drafted_tokens} "
               f"drafted, {self.accepted_tokens} accepted{share}; {self.steps_saved} model steps saved"
               + (f" ({len(self.decode)} of {self.calls} calls recorded these)" if unrecorded else "")]
        out += [f"  {d.line()}" for d in [d for d in self.decode if d.active][-5:]]
        return out


async def conversation_stats(store: Store, conversation_id: str) -> ConversationStats:
    """The figures of a stored conversation (``ConversationNotFound`` for an unknown id)."""
    messages = await store.messages(conversation_id, in_window_only=True)
    calls = await store.calls(conversation_id)
    last = calls[-1] if calls else None
    prefilled = sum(c.prefilled_tokens for c in calls)
    ttft = sum(c.ttft_s for c in calls if c.prefilled_tokens)
    return ConversationStats(
        conversation_id=conversation_id,
        window_tokens=sum(m.token_count for m in messages),
        kv_tokens=last.kv_tokens if last else 0,
        kv_bytes=last.kv_bytes if last else 0,
        snapshots=tuple(await store.snapshots(conversation_id)),
        calls=len(calls),
        reused_tokens=sum(c.reused_tokens + c.prefix_cache_tokens for c in calls),
        prefilled_tokens=prefilled,
        generated_tokens=sum(c.generated_tokens for c in calls),
        prefill_s_per_token=ttft / prefilled if prefilled else 0.0,
        compactions=sum(1 for c in calls if c.compaction),
        cache_breaks=tuple(str(c.cache_break.get("summary", c.cache_break)) for c in calls if c.cache_break),
        decode=tuple(d for d in (CallDecode.of(n, c) for n, c in enumerate(calls, start=1)) if d is not None),
    )


def _age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f}{unit}"
    return f"{seconds:.0f}s"
