"""Grammar fast-forward: the tokens a constraint forces, taken without sampling and fed with the
token before them as one chunk (one model step, the prefill path) instead of one step each.

The decode loop asks ``forced_source`` once per call, then ``next_forced`` before each token;
``FastForwardCounts`` is what the call's metrics report::

    source = forced_source(constraint, config)     # None: fast-forward off for this call
    token = next_forced(source)                    # None: the model chooses this token
    counts.forced += 1; counts.fed_in(len(chunk))  # GenerationMetrics.forced_tokens, steps_saved
    counts.confirmed += 1                          # a drafted token the model chose (prompt_lookup)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from agentkv.engine.base import GenerationConfig, TokenConstraint


@runtime_checkable
class ForcingConstraint(TokenConstraint, Protocol):
    """A ``TokenConstraint`` that also says which tokens it forces next (``GrammarConstraint``).
    A wrapper that changes the mask must not pass its inner constraint's ``forced_tokens`` on."""

    def forced_tokens(self) -> list[int]:
        """The tokens that must come next whatever the model says, in order (each the only token
        its mask allows); empty when the next token is a choice. No state change::

            ids = c.forced_tokens(); c.advance(ids[0])
        """
        ...


def forced_source(constraint: TokenConstraint | None, config: GenerationConfig) -> ForcingConstraint | None:
    """The constraint to take forced tokens from, or None when this call decodes one step per
    token: no constraint, one that cannot say what it forces, ``config.fast_forward`` off,
    log-probabilities asked for (a forced token fed inside a chunk has no logits of its own to
    report), or beams. ``forced_source(c, GenerationConfig())`` → ``c`` for a ``GrammarConstraint``."""
    if not config.fast_forward or config.logprobs is not None or config.num_beams > 1:
        return None
    return constraint if isinstance(constraint, ForcingConstraint) else None


def next_forced(source: ForcingConstraint | None) -> int | None:
    """The token ``source`` forces next, or None (no source, or the model must choose)::

        token = next_forced(source)
    """
    if source is None:
        return None
    forced = source.forced_tokens()
    return int(forced[0]) if forced else None


@dataclass
class FastForwardCounts:
    """One call's figures of tokens fed without a model step of their own (mutable, kept by the
    decode loop): forced runs fed as one chunk, and drafted tokens the model confirmed::

        counts = FastForwardCounts(); counts.fed_in(5); counts.confirmed += 2; counts.steps_saved   # 6
    """

    forced: int = 0
    """Tokens taken from the constraint's forced runs, without sampling."""
    fed: int = 0
    """Tokens the decode loop fed through the model."""
    feeds: int = 0
    """Feeds it fed them in (each one model step for this session)."""
    confirmed: int = 0
    """Drafted tokens the model chose too and that stay in the KV log (fed in a verify step ahead
    of the choice, so never fed by the loop): one model step each one-by-one decoding runs."""

    def fed_in(self, tokens: int) -> None:
        """Count one feed of ``tokens`` tokens."""
        self.fed += tokens
        self.feeds += 1

    @property
    def steps_saved(self) -> int:
        """Model steps saved against one step per token: the tokens that went into the KV log
        (fed, or confirmed drafts) less the feeds they took."""
        return self.fed + self.confirmed - self.feeds
