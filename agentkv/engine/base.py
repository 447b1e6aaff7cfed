"""The engine contract: GenerationConfig and the Engine / KVSession protocols (their results: ``generation.py``).

Everything above ``engine/`` (runner, policies, runtime) talks to a model only through these
types, so the real OpenVINO engine and the scripted test engine are interchangeable::

    session = await engine.open_session()
    result = await session.generate(prompt_ids, GenerationConfig(max_new_tokens=32))
    print(result.text, result.metrics.prefilled_tokens)

Every implementation keeps the invariant: the KV is exactly that of ``session.tokens`` (unless shifted).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from agentkv.engine.counters import EngineCounters
from agentkv.engine.generation import (
    GenerationMetrics,
    GenerationResult,
    GenerationStream,
)

if TYPE_CHECKING:
    from agentkv.kv.block_keys import KVNamespace
    from agentkv.kv.snapshot import KVSnapshot
    from agentkv.kvstore.block_store import BlockStore


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences: how much KV a prompt can reuse."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


MAX_LOGPROBS = 20
"""The most alternatives per token ``GenerationConfig.logprobs`` reports (OpenAI's bound too)."""


class GenerationConfig(BaseModel):
    """How to pick tokens: ``GenerationConfig(max_new_tokens=64)`` is greedy, ``temperature>0`` samples. Bad
    values (NaN, infinities) raise ``pydantic.ValidationError`` naming the field (through ``Agent``: ``UserError``)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    max_new_tokens: int = Field(256, ge=0)
    """Upper bound on generated tokens (the stop token included)."""
    temperature: float = Field(0.0, ge=0.0)
    """0 means greedy; >0 samples from the tempered distribution."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens (0 = off)."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling: keep the smallest set whose probability reaches top_p."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Drop tokens whose probability is below min_p × the top probability."""
    repetition_penalty: float = Field(1.0, gt=0.0)
    """>1 discourages tokens already in the prompt or the output (CTRL-style)."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted once from the logit of every token already generated."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """Subtracted per occurrence from the logit of every token already generated."""
    seed: int | None = Field(None, ge=0)
    """Seed for sampling (>= 0); the same seed gives the same tokens."""
    stop_token_ids: frozenset[int] = frozenset()
    """Extra token ids that end generation (the model's EOS always does unless ignore_eos)."""
    stop_strings: tuple[str, ...] = ()
    """Generation ends once the text contains one of these; it is cut from the text."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    num_beams: int = Field(1, ge=1)
    """>1 runs beam search through the model's beam_idx cache reorder."""
    length_penalty: float = 1.0
    """Beam score = sum logprob / len ** length_penalty."""
    num_return_sequences: int = Field(1, ge=1)
    """How many finished beams to return (≤ num_beams)."""
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    """Each token's log-probability and this many likeliest others (0..20) on ``TokenDelta.logprob``; None: off."""
    fast_forward: bool = True
    """Feed a grammar's forced tokens in one model step (same tokens; off with logprobs or beams)."""
    prompt_lookup: bool = True
    """Paged engine: check guesses copied from the session's log in one step (same tokens; sampled: same draws)."""
    decode_run: int = Field(8, ge=1, le=64)
    """Tokens decoded back to back, their deltas then streamed together (same tokens; 1: each as it is chosen)."""

    @model_validator(mode="after")
    def _check_beams(self) -> GenerationConfig:
        if self.num_return_sequences > self.num_beams:
            raise ValueError(
                f"num_return_sequences={self.num_return_sequences} exceeds "
                f"num_beams={self.num_beams}; raise num_beams or lower num_return_sequences"
            )
        if self.num_beams > 1 and self.temperature > 0:
            raise ValueError("beam search is deterministic: use temperature=0 with num_beams>1")
        if "" in self.stop_strings:
            raise ValueError("an empty stop string would end generation at once: drop it from stop_strings")
        if self.logprobs is not None and self.num_beams > 1:
            raise ValueError("log-probabilities are reported per sampled token: use num_beams=1 with logprobs")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids are token ids (>= 0), got {sorted(self.stop_token_ids)}")
        return self

    @property
    def greedy(self) -> bool:
        """True when every step takes the argmax."""
        return self.temperature == 0.0


class TokenConstraint(Protocol):
    """A per-step token mask (grammar-constrained decoding). See ``engine/decode/constraints.py``."""

    def allowed_mask(self) -> Any:
        """Boolean numpy mask over the vocabulary for the next token (pure, no state change)."""

    def advance(self, token_id: int) -> None:
        """Consume the chosen token (changes state)."""

    def is_finished(self) -> bool:
        """True once the grammar accepts and nothing more may follow."""


@runtime_checkable
class KVSession(Protocol):
    """One conversation's KV cache. Operations on one session are serialised by its own lock;
    callers need hold nothing. Every method may raise ``KVSessionClosed`` after ``close()``."""

    @property
    def id(self) -> str:
        """Unique id of the session inside its engine."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token log: exactly the tokens whose KV the session holds (read-only)."""

    @property
    def shifted(self) -> bool:
        """True once a span was dropped by RoPE shift: KV is close to, not equal to, a prefill."""

    def stream(
        self,
        prompt_tokens: Sequence[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None = None,
    ) -> GenerationStream:
        """Align to ``prompt_tokens`` (trim to the longest common prefix, prefill the rest), then decode. Mutates the KV
        and ``tokens``; generated tokens fed through the model join ``tokens``. Raises ``ContextOverflowError`` before
        touching the KV if prompt plus ``max_new_tokens`` cannot fit. Cancellation leaves both consistent."""

    async def generate(
        self,
        prompt_tokens: Sequence[int],
        config: GenerationConfig,
        constraint: TokenConstraint | None = None,
    ) -> GenerationResult:
        """``stream(...)`` run to the end."""

    async def prefill(self, prompt_tokens: Sequence[int]) -> GenerationMetrics:
        """Align to ``prompt_tokens`` without generating (mutates KV and tokens)."""

    async def next_token_logits(self) -> Any:
        """float32 ``[vocab]`` logits after ``tokens`` (may feed the last token again after a trim; no state change)."""

    async def trim(self, n: int) -> None:
        """Keep only the first ``n`` tokens of the log and their KV (mutates)."""

    async def fork(self) -> KVSession:
        """A new session with a copy of this KV and log; the two diverge independently."""

    async def snapshot(self, *, start: int = 0) -> KVSnapshot:
        """A host copy of the KV and log (no state change); ``start``: of the tokens from ``start``
        on only (a span, its cuts counted from ``start``): ``await kv.snapshot(start=256)``."""

    async def restore(self, snapshot: KVSnapshot) -> None:
        """Replace KV and log by the snapshot's. Raises ``SnapshotIncompatible`` for another
        model; on any failure the session is left empty, never with partial KV."""

    @property
    def supports_drop(self) -> bool:
        """True when ``drop`` exists for this session (no state change). A session may still
        raise ``KVShiftUnsupported`` from ``drop`` if the model's RoPE cannot be measured."""

    async def drop(self, start: int, end: int) -> None:
        """Remove ``tokens[start:end]`` and their KV without re-prefill: later keys are re-rotated by −(end−start)
        positions so positions stay contiguous. Mutates KV and ``tokens`` and sets ``shifted`` (the kept tokens' K/V
        were computed while the dropped ones were visible). Raises ``UserError`` for a span outside ``tokens`` and
        ``KVShiftUnsupported`` (nothing changed) when the shift cannot be done."""

    async def close(self) -> None:
        """Release the slot and the KV. Idempotent."""


class Tokenizer(Protocol):
    """Text ↔ ids and chat-template rendering, as the engine's model sees them (the OpenVINO
    engines' ``OVTokenizer`` and the scripted engine's tokenizer); the chat renderer uses it too."""

    eos_token_id: int
    """Its end-of-sequence id; the engine's ``eos_token_ids`` holds it (and those of generation_config.json)."""

    def encode(self, text: str) -> list[int]:
        """Ids for ``text`` with no BOS/EOS added (special-token text still maps to its id)."""

    def decode(self, ids: Sequence[int]) -> str:
        """Text for ``ids`` (special tokens kept as text)."""

    def apply_chat_template(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        add_generation_prompt: bool,
        tools: Sequence[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text for OpenAI-style message dicts."""


@runtime_checkable
class Engine(Protocol):
    """A model plus a pool of KV slots. ``open_session`` is cheap; a slot is bound lazily."""

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Ids that end an assistant turn."""

    @property
    def max_context_len(self) -> int:
        """Most tokens a session may hold."""

    @property
    def fingerprint(self) -> str:
        """Identifies model + KV layout; snapshots from another fingerprint are refused."""

    @property
    def exact(self) -> bool:
        """True when the engine's numerics are exact (f32 KV, f32 compute, no dynamic quantisation:
        ``open_engine(exact=True)``): its KV never depends on how a prefill was chunked, and what would make it only
        close (a RoPE shift of earlier thinking, the default self-check tolerance) is not chosen by default."""

    def kv_namespace(self, *, salt: str = "", block_size: int = 32) -> KVNamespace:
        """What makes this engine's KV of the same tokens bit-identical, for tenant ``salt``: the KV
        store's namespace (``kv/block_keys.py``): ``engine.kv_namespace(salt="a").chain(snap.tokens)``."""

    def keep_offloaded_kv_in(self, blocks: BlockStore, *, block_size: int) -> None:
        """Offload idle sessions' KV into ``blocks`` (the runtime's store's: one host tier for both):
        ``engine.keep_offloaded_kv_in(store.blocks, block_size=store.block_size)``."""

    async def open_session(self, *, salt: str = "") -> KVSession:
        """A new empty session; ``salt`` names its tenant (prefixes are cached per salt)."""

    def register_prefix(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Mark ``tokens`` (system prompt + tool schemas) as a shared prefix to cache for tenant ``salt``."""

    def make_constraint(self, grammar: str) -> TokenConstraint | None:
        """A fresh grammar constraint for one generation (llguidance Lark grammar), or None
        when the engine decodes without one (the scripted engine records the grammar)."""

    async def aclose(self) -> None:
        """Close every session and release the model."""

    def counters(self) -> EngineCounters:
        """What the engine holds and has done now (a consistent copy; changes nothing), read by
        the server's ``/metrics``: ``engine.counters().kv_blocks_used``."""
        ...
