"""ScriptedEngine: a deterministic engine that replays scripted replies through the real session code.

Each ``generate`` call pops the next reply — a reply string, a function of the call, or an
exception to raise — and decodes the reply's tokens (then ``<|im_end|>``). It is a
``SlotEngine`` over fake KV slots (``testing/fake_kv.py``): alignment, the token log, metrics,
streaming, stop strings, ``max_new_tokens``, trim / fork / offload / snapshot / restore / drop
and their errors are the engine's own code, not a copy::

    engine = ScriptedEngine(["Hello!", lambda call: f"You said {len(call.prompt_ids)} tokens"])
    session = await engine.open_session()
    tok = engine.tokenizer
    chat = [{"role": "user", "content": "hi"}]
    ids = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
    result = await session.generate(ids, GenerationConfig(max_new_tokens=32))
    assert result.text == "Hello!" and result.metrics.prefilled_tokens == len(ids)
    engine.calls[0].prompt_text   # what the "model" was shown
"""

from __future__ import annotations

import inspect
import os
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
import anyio.lowlevel

from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import GenerationMetrics, GenerationResult
from agentkv.kv.rope import FIT_TOLERANCE
from agentkv.engine.session.backend import RopeReference, SlotBackend
from agentkv.engine.session.slot_engine import SlotEngine
from agentkv.errors import UserError
from agentkv.testing.fake_kv import KV_BYTES_PER_TOKEN, ROPE_THETA, FakeSlot
from agentkv.testing.session import ScriptedSession
from agentkv.testing.tokenizer import ScriptedTokenizer

FINGERPRINT = "scripted"
T = TypeVar("T")


@dataclass
class ScriptedCall:
    """One ``generate`` / ``stream`` call as the scripted engine saw it."""

    index: int
    """0-based position among the engine's calls."""
    session_id: str
    """Id of the session that made the call."""
    prompt_ids: tuple[int, ...]
    """The prompt tokens passed in."""
    prompt_text: str
    """``tokenizer.decode(prompt_ids)``: the rendered prompt, special tokens kept."""
    config: GenerationConfig
    """The generation settings passed in."""
    constraint_given: bool
    """True when a ``TokenConstraint`` object was passed."""
    grammar: str | None = None
    """The grammar last requested through ``engine.make_constraint`` before this call, if any."""
    reply: str | None = None
    """The scripted reply text used (None when the reply was an exception)."""
    result: GenerationResult | None = None
    """Set once the call finished."""

    @property
    def metrics(self) -> GenerationMetrics | None:
        """The finished call's metrics (None while running or after an error)."""
        return None if self.result is None else self.result.metrics


ScriptedReply = str | Callable[[ScriptedCall], str | Awaitable[str]] | Exception
"""A scripted reply: its text, a (sync or async) function of the call returning it, or an error."""


def _check_reply(reply: object) -> None:
    if not (isinstance(reply, (str, Exception)) or callable(reply)):
        raise UserError(
            f"a scripted reply is a str, a callable (ScriptedCall) -> str, or an Exception "
            f"instance; got {type(reply).__name__}"
        )


class ScriptedEngine(SlotEngine):
    """An ``Engine`` whose "model" replays scripted replies; see the module docstring."""

    session_class = ScriptedSession

    def __init__(
        self,
        replies: Iterable[ScriptedReply] | ScriptedReply = (),
        *,
        max_context_len: int = 8192,
        prefill_s_per_token: float = 0.0,
        decode_s_per_token: float = 0.0,
        num_slots: int = 16,
        prefix_cache_bytes: int | None = 0,
        offload_bytes: int | None = None,
        spill_dir: str | os.PathLike[str] | None = None,
        prefill_chunk_size: int | None = None,
        exact: bool = False,
    ) -> None:
        """``*_s_per_token`` make the "model" slow (a step over one token is a decode step);
        ``num_slots`` sessions keep their fake KV in a slot, more are offloaded as on a real
        engine; ``prefix_cache_bytes`` > 0 (or None: unbounded) turns the prefix cache on;
        ``exact`` plays an engine with exact numerics (``open_engine(exact=True)``)."""
        if max_context_len < 2:
            raise UserError(f"max_context_len must be >= 2, got {max_context_len}")
        if prefill_s_per_token < 0 or decode_s_per_token < 0:
            raise UserError("prefill_s_per_token and decode_s_per_token must be >= 0")
        if num_slots < 1:
            raise UserError(f"num_slots must be >= 1, got {num_slots}")
        tokenizer = ScriptedTokenizer()
        super().__init__(ScriptedBackend(
            self, slots=[FakeSlot(tokenizer.n_vocab, self._step_seconds) for _ in range(num_slots)],
            tokenizer=tokenizer, fingerprint=FINGERPRINT, eos_token_ids={tokenizer.eos_token_id},
            max_context_len=max_context_len, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            prefill_chunk_size=prefill_chunk_size, prefix_cache_bytes=prefix_cache_bytes,
            offload_bytes=offload_bytes, spill_dir=spill_dir, rope_reference=_rope_reference,
        ))
        self._scripted_tokenizer = tokenizer
        self._exact = exact
        self.prefill_s_per_token = prefill_s_per_token
        self.decode_s_per_token = decode_s_per_token
        self._replies: deque[ScriptedReply] = deque()
        self.calls: list[ScriptedCall] = []
        """Every generate call, in the order they started."""
        self.registered_prefixes: list[tuple[int, ...]] = []
        """Every ``register_prefix`` argument, in order."""
        self.requested_grammars: list[str] = []
        """Every ``make_constraint`` argument, in order."""
        self._pending_grammar: str | None = None
        if isinstance(replies, (str, Exception)) or callable(replies):
            replies = [replies]
        self.add_replies(*replies)

    # ---- Engine protocol ---------------------------------------------------------------
    @property
    def exact(self) -> bool:
        """Whether this engine plays exact numerics (``ScriptedEngine(exact=True)``), as
        ``OpenVINOEngine.exact`` reports its plugin's."""
        return self._exact

    @property
    def tokenizer(self) -> ScriptedTokenizer:
        return self._scripted_tokenizer

    def register_prefix(self, tokens: Sequence[int], *, salt: str = "") -> None:
        """Register ``tokens`` as the engine does, and record them in ``registered_prefixes``."""
        super().register_prefix(tokens, salt=salt)
        self.registered_prefixes.append(tuple(int(t) for t in tokens))

    def make_constraint(self, grammar: str) -> None:
        """Record the grammar (the next call's ``ScriptedCall.grammar``); replies are fixed text."""
        self.requested_grammars.append(grammar)
        self._pending_grammar = grammar

    def _model_steps(self) -> int:
        """The "model" runs once per call: ``engine.counters().model_steps == len(engine.calls)``."""
        return len(self.calls)

    # ---- the script --------------------------------------------------------------------
    def add_replies(self, *replies: ScriptedReply) -> None:
        """Append replies to the FIFO: ``engine.add_replies("ok", ValueError("boom"))``."""
        for reply in replies:
            _check_reply(reply)
        self._replies.extend(replies)

    @property
    def remaining_replies(self) -> int:
        """Steps not yet consumed."""
        return len(self._replies)

    def assert_complete(self) -> None:
        """Raise ``AssertionError`` if scripted replies were never used."""
        if self._replies:
            listed = ", ".join(repr(reply) for reply in list(self._replies)[:5])
            raise AssertionError(
                f"{len(self._replies)} scripted reply(ies) were never used after {len(self.calls)} "
                f"call(s): {listed}; remove them or make the code under test call the model again"
            )

    def begin_call(
        self, session_id: str, prompt: list[int], config: GenerationConfig, constrained: bool
    ) -> ScriptedCall:
        """Record a new call (taking any pending grammar)."""
        grammar, self._pending_grammar = self._pending_grammar, None
        call = ScriptedCall(
            index=len(self.calls),
            session_id=session_id,
            prompt_ids=tuple(prompt),
            prompt_text=self._scripted_tokenizer.decode(prompt),
            config=config,
            constraint_given=constrained,
            grammar=grammar,
        )
        self.calls.append(call)
        return call

    async def reply_for(self, call: ScriptedCall) -> str:
        """Pop the next reply and turn it into reply text (raising scripted errors)."""
        if not self._replies:
            tail = call.prompt_text[-120:]
            raise AssertionError(
                f"ScriptedEngine ran out of replies at call #{call.index} (session {call.session_id}, "
                f"prompt ending {tail!r}); script a reply with engine.add_replies(...)"
            )
        scripted = self._replies.popleft()
        if isinstance(scripted, Exception):
            raise scripted
        reply = scripted if isinstance(scripted, str) else scripted(call)
        if inspect.isawaitable(reply):
            reply = await reply
        if not isinstance(reply, str):
            raise UserError(f"a scripted reply function must return str, got {type(reply).__name__}")
        call.reply = reply
        return reply

    # ---- the fake model ----------------------------------------------------------------
    def _step_seconds(self, tokens: int) -> float:
        """How long a fake step over ``tokens`` takes (read at each step: tests may change the pace)."""
        return tokens * (self.decode_s_per_token if tokens == 1 else self.prefill_s_per_token)


class ScriptedBackend(SlotBackend):
    """The real ``SlotBackend`` over fake slots, with the engine's script at hand (``script``:
    its sessions take their replies from it)::

        ScriptedBackend(engine, slots=[FakeSlot(vocab)], tokenizer=tok, fingerprint="scripted", ...)
    """

    decodes_in_thread = False
    """The token loop awaits each fake step (an instant one runs inline: tests see a
    deterministic interleaving; a paced one in a worker thread, as a real step)."""

    def __init__(self, script: ScriptedEngine, **options: Any) -> None:
        self.script = script
        super().__init__(**options)

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """A paced step runs in a worker thread (as a real one); an instant one runs inline,
        then yields to the event loop (cancellation is delivered after the step, as in a thread)."""
        if self.script.prefill_s_per_token or self.script.decode_s_per_token:
            return await super().run_blocking(fn, *args)
        result = fn(*args)
        await anyio.lowlevel.checkpoint()
        return result


def _rope_reference() -> RopeReference:
    """The fake model's "metadata" θ (its one pair turns 1 rad/position for any θ) and the f32
    floor: the backend's own procedure then verifies it on a fake slot."""
    return (ROPE_THETA, 1.0), FIT_TOLERANCE["f32"]
