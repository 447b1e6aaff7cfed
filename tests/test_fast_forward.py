"""Tests of grammar fast-forward (``agentkv/engine/decode/fast_forward.py`` and the decode loop):
forced tokens are taken without a model choice and fed with the token before them as one chunk,
while the stream, stop ids, stop strings, ``max_new_tokens`` and cancellation behave as with one
feed per token; ``GrammarConstraint.forced_tokens`` is what llguidance's masks force. No model runs
here (the real-model tests are in ``tests/model/test_fast_forward_model.py``)."""

from __future__ import annotations

import numpy as np
import pytest

from agentkv.chat.messages import ToolCall
from agentkv.chat.toolcalls import format_tool_calls, tool_call_grammar
from agentkv.engine.base import GenerationConfig
from agentkv.engine.generation import TokenDelta
from agentkv.engine.decode.constraints import ConstraintFactory
from agentkv.engine.decode.fast_forward import FastForwardCounts, ForcingConstraint, forced_source
from agentkv.engine.decode.token_steps import DecodeOutcome, TokenSteps
from _drive import DRIVERS, blocking_executor, drive
from agentkv.engine.openvino.models import resolve_model
from agentkv.engine.openvino.tokenizer import OVTokenizer
from agentkv.testing import ScriptedEngine

EOS = 2
ANSWER = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
"""The answer the fake "grammar" below takes: positions in ``FORCED`` are forced."""
FORCED = {0, 1, 2, 4, 5, 8, 9}


class ScriptedGrammar:
    """A constraint that takes ``ANSWER`` and forces its ``FORCED`` positions, then finishes."""

    def __init__(self, answer: list[int] = ANSWER, forced: set[int] = FORCED) -> None:
        self.answer, self.forced, self.seen = answer, forced, 0

    def allowed_mask(self) -> np.ndarray:
        mask = np.zeros(64, dtype=bool)
        mask[self.answer[self.seen]] = True
        return mask

    def advance(self, token_id: int) -> None:
        assert token_id == self.answer[self.seen], "the loop took a token the grammar does not allow"
        self.seen += 1

    def is_finished(self) -> bool:
        return self.seen == len(self.answer)

    def forced_tokens(self) -> list[int]:
        run = []
        for position in range(self.seen, len(self.answer)):
            if position not in self.forced:
                break
            run.append(self.answer[position])
        return run


class MaskOnly:
    """A wrapper that changes nothing but does not say what it forces: no fast-forward."""

    def __init__(self, inner: ScriptedGrammar) -> None:
        self.inner = inner

    def allowed_mask(self) -> np.ndarray:
        return self.inner.allowed_mask()

    def advance(self, token_id: int) -> None:
        self.inner.advance(token_id)

    def is_finished(self) -> bool:
        return self.inner.is_finished()


async def decode(config: GenerationConfig, *, fast: bool, stop_ids: frozenset[int] = frozenset(), max_new: int = 32,
                 answer: list[int] = ANSWER, close_after: int | None = None, driver: str = "event-loop"):
    """Run the token loop through ``driver`` with a chooser that reads the grammar's one allowed
    token; returns the deltas, the outcome (None when closed early), the feeds, the tokens chosen
    the counts and what the feeds left in the fake KV log (trims included)."""
    grammar = ScriptedGrammar(answer)
    feeds: list[list[int]] = []
    chosen: list[int] = []

    def choose(generated: list[int]) -> int:
        chosen.append(answer[len(generated)])
        return chosen[-1]

    def feed(tokens: list[int]) -> None:
        feeds.append(list(tokens))
        log.extend(tokens)

    def trim(keep: int) -> None:
        del log[keep:]

    counts, log = FastForwardCounts(), []
    steps = TokenSteps(choose, config=config, decode_text=lambda ids: "".join(f"<{i}>" for i in ids),
                       stop_ids=stop_ids, max_new=max_new, constraint=grammar,
                       forcing=forced_source(grammar, config) if fast else None, counts=counts)
    events = drive(steps, blocking_executor(feed, lambda ids, rows: None, trim), driver)
    deltas: list[TokenDelta] = []
    outcome = None
    async for event in events:
        if isinstance(event, DecodeOutcome):
            outcome = event
        else:
            deltas.append(event)
            if close_after is not None and len(deltas) == close_after:
                await events.aclose()
                break
    return deltas, outcome, feeds, chosen, counts, log


@pytest.mark.parametrize("driver", DRIVERS)
async def test_a_forced_run_is_fed_with_the_token_before_it_as_one_chunk(driver):
    deltas, outcome, feeds, chosen, counts, _ = await decode(GenerationConfig(), fast=True, driver=driver)
    assert [d.token_id for d in deltas] == ANSWER and outcome.generated == ANSWER
    assert outcome.finish_reason == "constraint"
    assert chosen == [13, 16, 17]  # only the positions the grammar does not force
    assert feeds == [[10, 11, 12], [13, 14, 15], [16], [17, 18]]  # the finishing token is not fed
    assert (counts.forced, counts.fed, counts.feeds, counts.steps_saved) == (7, 9, 4, 5)


async def test_without_fast_forward_every_token_is_chosen_and_fed_alone_with_the_same_output():
    fast = await decode(GenerationConfig(), fast=True)
    plain = await decode(GenerationConfig(fast_forward=False), fast=True)
    deltas, outcome, feeds, chosen, counts, _ = plain
    assert chosen == ANSWER and feeds == [[t] for t in ANSWER[:-1]] and counts.steps_saved == counts.forced == 0
    assert [(d.token_id, d.text) for d in deltas] == [(d.token_id, d.text) for d in fast[0]]
    assert outcome.text == fast[1].text


@pytest.mark.parametrize("max_new", [1, 2, 5, 9])
async def test_max_new_tokens_cuts_a_forced_run_and_the_fed_tokens_match_one_by_one(max_new):
    fast = await decode(GenerationConfig(), fast=True, max_new=max_new)
    plain = await decode(GenerationConfig(), fast=False, max_new=max_new)
    assert fast[1].generated == plain[1].generated == ANSWER[:max_new]
    assert fast[1].finish_reason == plain[1].finish_reason == "length"
    assert sum(fast[2], []) == sum(plain[2], []) == ANSWER[: max_new - 1]


@pytest.mark.parametrize("stop", ["<11>", "<14><15>", "<18>"])
async def test_a_stop_string_inside_a_forced_run_stops_where_one_by_one_decoding_stops(stop):
    config = GenerationConfig(stop_strings=(stop,))
    fast = await decode(config, fast=True)
    plain = await decode(config, fast=False)
    assert fast[1].generated == plain[1].generated and fast[1].text == plain[1].text
    assert fast[1].finish_reason == "stop" and stop not in fast[1].text
    assert sum(fast[2], []) == sum(plain[2], []) == fast[1].generated[:-1]


async def test_a_forced_stop_id_ends_generation_unfed():
    answer = [10, 11, EOS, 13]
    deltas, outcome, feeds, _, counts, _ = await decode(GenerationConfig(), fast=True, stop_ids=frozenset({EOS}),
                                                        answer=answer)
    assert outcome.generated == [10, 11, EOS] and outcome.finish_reason == "stop"
    assert feeds == [[10, 11]] and counts.forced == 3


@pytest.mark.parametrize("driver", DRIVERS)
async def test_closing_the_stream_inside_a_forced_run_keeps_a_prefix_of_what_was_streamed(driver):
    deltas, outcome, feeds, _, _, log = await decode(GenerationConfig(), fast=True, close_after=5, driver=driver)
    assert outcome is None and [d.token_id for d in deltas] == ANSWER[:5]
    plain_log = [10, 11, 12]  # one-by-one decoding's log at the 5th delta (13, 14 forced, pending)
    assert log == plain_log
    if driver == "event-loop":
        assert sum(feeds, []) == plain_log  # nothing fed past the close
    # NOTE: the thread may have fed past the delta the consumer stopped at; the settle trimmed it


def test_fast_forward_is_off_without_a_forcing_constraint_with_logprobs_beams_or_when_switched_off():
    grammar = ScriptedGrammar()
    assert isinstance(grammar, ForcingConstraint) and forced_source(grammar, GenerationConfig()) is grammar
    assert forced_source(None, GenerationConfig()) is None
    assert forced_source(MaskOnly(grammar), GenerationConfig()) is None
    assert forced_source(grammar, GenerationConfig(fast_forward=False)) is None
    assert forced_source(grammar, GenerationConfig(logprobs=2)) is None
    assert forced_source(grammar, GenerationConfig(num_beams=2)) is None


async def test_the_scripted_engine_replays_its_script_and_forces_nothing():
    engine = ScriptedEngine(["one two"])
    tok = engine.tokenizer
    reply = tok.encode("one two") + [tok.eos_token_id]
    grammar = ScriptedGrammar(reply, forced=set(range(len(reply))))
    session = await engine.open_session()
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    result = await session.generate(ids, GenerationConfig(max_new_tokens=16), grammar)
    assert result.text == "one two" and result.metrics.forced_tokens == result.metrics.steps_saved == 0


def test_the_tool_call_grammar_forces_only_tokens_its_mask_allows_alone():
    tokenizer = OVTokenizer(resolve_model(None).ir_dir)
    meta = resolve_model(None).gguf_metadata()
    factory = ConstraintFactory(meta["tokenizer.ggml.tokens"], eos_token_id=EOS, vocab_size=49152,
                                token_types=meta["tokenizer.ggml.token_type"], encode=tokenizer.encode)
    tools = [{"type": "function", "function": {"name": "geo.distance", "parameters": {
        "type": "object", "properties": {"start": {"type": "string"}, "end": {"type": "string"}},
        "required": ["start", "end"]}}}]
    constraint = factory(tool_call_grammar(tools, "required", parallel=False))
    call = tokenizer.encode(format_tool_calls([ToolCall(name="geo.distance", arguments={"start": "A", "end": "B"})]))
    forced_positions = 0
    for position, token in enumerate(call):
        forced = constraint.forced_tokens()
        mask = constraint.allowed_mask()
        if forced:
            assert forced == call[position:position + len(forced)]
            assert np.flatnonzero(mask).tolist() == [token]
            forced_positions += 1
        else:
            assert mask.sum() > 1
        constraint.advance(token)
    assert forced_positions > len(call) // 2  # markup, name and keys: most of a call is forced
