"""`make demo` answers right on every CPU-plugin profile the suite knows (issue 23, item 18).

The demo runs on the default engine with the plugin's default numerics, which differ by CPU
(bf16 compute here, dynamic quantisation on avx512, plain f32 without it). Each profile asks the
plugin for one behaviour (``tests/_numerics.py``); one this CPU ignores, or computes bit for bit as a
profile already run, is skipped, saying why.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anyio
import pytest

from _numerics import PROFILES, skip_if_computed_as_before, skip_if_ignored

pytestmark = pytest.mark.model

ROOT = Path(__file__).resolve().parents[2]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def profile_engine(profile: str):
    """The demo's engine (``open_engine``, the paged one) with the profile's plugin settings."""
    from agentkv import open_engine

    engine = open_engine(ov_config=dict(PROFILES[profile]), num_slots=1, kv_cache_bytes=32 << 20)
    skip_if_ignored(profile, engine)
    return engine


@pytest.mark.parametrize("profile", list(PROFILES))
def test_the_demo_answers_paris_and_a_paris_landmark_on_every_plugin_profile(profile, capsys):
    demo = load_example("chat_demo")
    anyio.run(skip_if_computed_as_before, profile, __name__)
    engine = profile_engine(profile)

    async def run():
        try:
            return await demo.converse(engine, on_event=lambda event: None)
        finally:
            await engine.aclose()

    capital, landmark = anyio.run(run)
    assert "Paris" in capital, (profile, str(engine.numerics), capital)
    assert "Eiffel Tower" in landmark or "Louvre" in landmark, (profile, str(engine.numerics), landmark)
