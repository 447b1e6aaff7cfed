"""Deterministic fakes for tests: a scripted engine that honours the real Engine / KVSession protocol.

::

    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["The answer is 2."])
    session = await engine.open_session()
    ...
    engine.assert_complete()
"""

from agentkv.testing.fake_kv import FakeSlot
from agentkv.testing.scripted import ScriptedCall, ScriptedEngine, ScriptedSession, Step
from agentkv.testing.tokenizer import ScriptedTokenizer

__all__ = ["FakeSlot", "ScriptedCall", "ScriptedEngine", "ScriptedSession", "ScriptedTokenizer", "Step"]
