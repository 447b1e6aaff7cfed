"""open_engine: the paged engine by default on CPU, the stateful one when asked, on NPU, or when
the model has no paged form; clear errors for a backend that does not exist."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from agentkv import UserError, open_engine


def test_an_unknown_backend_is_refused_with_the_choices():
    with pytest.raises(UserError, match="auto, paged, stateful"):
        open_engine(backend="fast")  # type: ignore[arg-type]


def test_an_unknown_backend_in_the_environment_names_the_variable(monkeypatch):
    monkeypatch.setenv("AGENTKV_ENGINE", "gpu-magic")
    with pytest.raises(UserError, match="AGENTKV_ENGINE"):
        open_engine()


def tiny_model():
    """A one-op OpenVINO model: compiles in milliseconds, no model files needed."""
    import numpy as np
    import openvino as ov
    import openvino.opset13 as ops

    x = ops.parameter([1, 4], np.float32, name="x")
    return ov.Model([ops.relu(x)], [x], "tiny")


def test_a_cache_dir_that_cannot_be_created_compiles_without_the_cache_and_warns_once(tmp_path, caplog):
    import openvino as ov

    from agentkv.engine.openvino.compile import compile_for_device

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory", encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.openvino.compile"):
        compiled = compile_for_device(ov.Core(), tiny_model(), "CPU", {"CACHE_DIR": str(blocker / "sub")})
    assert compiled.outputs
    [record] = caplog.records
    assert "compiling without it" in record.getMessage() and str(blocker / "sub") in record.getMessage()


def test_a_cache_write_failure_inside_openvino_is_named_and_the_model_compiles_without_the_cache(
        tmp_path, monkeypatch, caplog):
    import openvino as ov

    from agentkv.engine.openvino.compile import compile_for_device

    core = ov.Core()
    real = core.compile_model

    def cache_fails(model, device, config):
        if "CACHE_DIR" in config:  # what was seen while several processes shared one cache dir
            raise RuntimeError("Exception from src/inference/src/cpp/core.cpp:117:\n"
                               "filesystem error: cannot set permissions: Operation not permitted\n")
        return real(model, device, config)

    monkeypatch.setattr(core, "compile_model", cache_fails)
    with caplog.at_level(logging.WARNING, logger="agentkv.engine.openvino.compile"):
        compiled = compile_for_device(core, tiny_model(), "CPU", {"CACHE_DIR": str(tmp_path)})
    assert compiled.outputs
    assert "cannot set permissions" in caplog.text and "device" not in caplog.text


def test_a_failure_that_is_not_about_the_device_names_its_cause_not_the_devices(tmp_path):
    import openvino as ov

    from agentkv.errors import ModelCompileFailed

    from agentkv.engine.openvino.compile import compile_for_device

    with pytest.raises(ModelCompileFailed, match="Unsupported property NOT_A_KEY") as caught:
        compile_for_device(ov.Core(), tiny_model(), "CPU", {"CACHE_DIR": str(tmp_path), "NOT_A_KEY": "1"})
    assert "pass one of those" not in str(caught.value) and caught.value.device == "CPU"


def test_naming_the_compiled_cache_dir_never_fails_even_under_a_file(tmp_path, monkeypatch):
    from agentkv.engine.openvino.models import CACHE_ENV, compiled_cache_dir

    blocker = tmp_path / "a-file"
    blocker.write_text("", encoding="utf-8")
    monkeypatch.setenv(CACHE_ENV, str(blocker / "cache"))
    assert compiled_cache_dir() == blocker / "cache" / "compiled"  # compile_for_device then warns and goes on


def test_a_gguf_that_cannot_be_converted_fails_once_with_its_cause_not_a_paged_fallback(tmp_path, monkeypatch,
                                                                                       caplog):
    import openvino_genai

    from agentkv.engine.openvino.models import CACHE_ENV
    from agentkv.errors import ModelNotFound

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00 truncated")
    real = openvino_genai.LLMPipeline
    conversions = []

    def counted(*args, **kwargs):
        conversions.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(openvino_genai, "LLMPipeline", counted)
    with caplog.at_level(logging.WARNING), pytest.raises(ModelNotFound, match="with gguf_open") as caught:
        open_engine(broken)
    assert len(conversions) == 1
    assert str(broken) in str(caught.value) and "failed at" not in str(caught.value)
    assert "paged engine is not available" not in caplog.text


def test_a_bad_paged_option_is_the_callers_error_not_a_fallback_to_the_stateful_engine(monkeypatch):
    """Only a model without a paged form (``PagedFormUnsupported``) or OpenVINO's own error makes
    ``open_engine`` fall back; a paged option out of range is raised as it is."""
    import agentkv.engine.factory as factory

    monkeypatch.delenv("AGENTKV_ENGINE", raising=False)
    monkeypatch.setattr(factory, "_ir_dir", lambda model: Path("unused"))
    monkeypatch.setattr(factory, "_paged", lambda ir_dir, device, options: (_ for _ in ()).throw(
        UserError("kv_cache_bytes must be > 0, got 0")))
    with pytest.raises(UserError, match="kv_cache_bytes must be > 0"):
        factory.open_engine(None, kv_cache_bytes=0)
