"""compile.lm_head: the LM head MatMul is found behind an elementwise tail (Gemma 2's logit softcap,
a scale), so both forms keep only the last positions; any other tail is refused; the paged graph's
``next_token`` is numpy's argmax. Toy graphs, no model files."""

from __future__ import annotations

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import pytest

from agentkv.engine.openvino.compile import lm_head
from agentkv.engine.stateful.engine import slice_last_position

CAP = 3.0
RNG = np.random.default_rng(0)
WEIGHT = RNG.standard_normal((4, 6)).astype(np.float32)


def toy_lm(tail: str, weight: np.ndarray = WEIGHT) -> ov.Model:
    """``hidden [batch, T, 4]`` → MatMul ``[4, 6]`` → ``tail`` → Result "logits"."""
    hidden = ops.parameter([-1, -1, 4], np.float32, name="hidden")
    logits: ov.Node = ops.matmul(hidden, ops.constant(weight), False, False)
    if tail == "softcap":  # as optimum-intel exports Gemma 2: Divide → Tanh → Multiply, f16 caps
        cap = ops.convert(ops.constant(np.full((1, 1, 1), CAP, np.float16)), np.float32)
        logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
    elif tail == "softmax":
        logits = ops.softmax(logits, -1)
    elif tail == "per-position bias":
        logits = ops.add(logits, ops.constant(np.ones((1, 3, 6), np.float32)))
    elif tail == "input-dependent scale":
        logits = ops.multiply(logits, ops.reduce_max(logits, np.array([-1], np.int64), True))
    logits.output(0).get_tensor().set_names({"logits"})
    return ov.Model([logits], [hidden], "toy-lm")


def test_a_softcap_tail_is_walked_back_to_the_matmul_and_the_slice_keeps_it() -> None:
    model = toy_lm("softcap")
    assert lm_head(model) is not None
    assert slice_last_position(model)
    hidden = RNG.standard_normal((1, 3, 4)).astype(np.float32) * 4
    got = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})({"hidden": hidden})[0]
    want = CAP * np.tanh(hidden[:, -1:, :] @ WEIGHT / CAP)
    assert got.shape == (1, 1, 6)
    np.testing.assert_allclose(got, want, atol=1e-5)


def test_a_plain_matmul_is_the_lm_head() -> None:
    model = toy_lm("none")
    assert lm_head(model) is model.output("logits").get_node().input_value(0).get_node()


@pytest.mark.parametrize("tail", ["softmax", "per-position bias", "input-dependent scale"])
def test_a_tail_that_mixes_positions_or_values_is_refused(tail: str) -> None:
    model = toy_lm(tail)
    assert lm_head(model) is None
    assert not slice_last_position(model)



def test_next_token_is_numpy_argmax_the_lowest_id_among_equal_logits_without_a_sort() -> None:
    from agentkv.engine.paged.graphs import add_next_token

    model = toy_lm("none", weight=np.repeat(WEIGHT[:, :3], 2, axis=1))  # ids 2i and 2i+1 always tie
    add_next_token(model)
    assert "TopK" not in {op.get_type_name() for op in model.get_ops()}  # a stable TopK sorts: 23 ms for 13 rows
    hidden = RNG.standard_normal((5, 3, 4)).astype(np.float32)
    hidden[1] = 0.0  # every logit equal: id 0
    compiled = ov.Core().compile_model(model, "CPU")
    out = compiled({"hidden": hidden})
    logits, best = out[compiled.output("logits")], out[compiled.output("next_token")][..., 0]
    assert np.array_equal(best, np.argmax(logits, axis=-1))
    assert np.all(best % 2 == 0) and np.all(best[1] == 0)
