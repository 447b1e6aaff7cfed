"""The prompt a call aligns: the checks made before any state changes (``validate_prompt``) and
how the prompt met the session's KV (``Alignment``, the counts a call's metrics start from)::

    validate_prompt(prompt, config, max_context_len=8192)     # raises before touching the KV
    align = Alignment.counted(reused=40, cached=0, restored=0, prefilled=8, recomputed=0)
    metrics = align.metrics(generated=3, ttft=0.1, tpot=0.02, kv_tokens=51, kv_bytes=51 * 46_080)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import GenerationMetrics
from agentkv.errors import ContextOverflowError, UserError


def validate_prompt(prompt: Sequence[int], config: GenerationConfig, max_context_len: int) -> None:
    """The checks every ``KVSession.stream`` makes before touching any state.

    Raises ``UserError`` for an empty prompt or stop strings with beams, and
    ``ContextOverflowError`` when the prompt does not fit the context.
    """
    if not prompt:
        raise UserError("prompt_tokens is empty: render at least one token before generating")
    if config.num_beams > 1 and config.stop_strings:
        raise UserError("stop_strings are not supported with num_beams>1; use stop_token_ids")
    if len(prompt) >= max_context_len:
        raise ContextOverflowError(
            f"prompt of {len(prompt)} tokens does not fit the model's context of {max_context_len}; "
            "shorten the history or give the agent a context-window policy",
            prompt_tokens=len(prompt),
            limit=max_context_len,
        )


@dataclass(frozen=True)
class Alignment:
    """How a prompt met a session's KV before any token was generated (every engine's counts)."""

    reused: int
    """Prompt tokens whose KV the session already held."""
    prefix_cache: int
    """Prompt tokens whose KV came from the shared prefix cache."""
    restored: int
    """Of ``reused``, the tokens that came back from an offloaded or restored snapshot."""
    prefilled: int
    """Prompt tokens run through the model."""

    @classmethod
    def counted(cls, *, reused: int, cached: int, restored: int, prefilled: int, recomputed: int) -> Alignment:
        """The counts of one alignment. Tokens the session re-prefilled when it got its slot back
        (its offloaded KV had been dropped) count as prefilled, not reused: nothing was reused."""
        recomputed = min(recomputed, reused)
        return cls(reused=reused - recomputed, prefix_cache=cached, restored=min(restored, reused),
                   prefilled=prefilled + recomputed)

    def metrics(self, *, generated: int, ttft: float, tpot: float, kv_tokens: int, kv_bytes: int,
                kv_exact: bool = True) -> GenerationMetrics:
        """The call's metrics: ``align.metrics(generated=3, ttft=0.1, tpot=0.02, kv_tokens=40, kv_bytes=...)``."""
        return GenerationMetrics(
            prompt_tokens=self.reused + self.prefix_cache + self.prefilled,
            reused_tokens=self.reused,
            prefix_cache_tokens=self.prefix_cache,
            restored_tokens=self.restored,
            prefilled_tokens=self.prefilled,
            generated_tokens=generated,
            ttft_s=ttft,
            tpot_s=tpot,
            kv_tokens=kv_tokens,
            kv_bytes=kv_bytes,
            kv_exact=kv_exact,
        )
