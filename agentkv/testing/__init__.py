"""Deterministic fakes for tests: a scripted engine that honours the real Engine / KVSession protocol.

::

    from agentkv.testing import ScriptedEngine

    engine = ScriptedEngine(["The answer is 2."])
    session = await engine.open_session()
    ...
    engine.assert_complete()

Also ``forbid_real_engines()``, the switch that makes building a real engine raise (the test
suite wraps every test not marked ``model`` in it), and ``FakeClock``, a clock for lease tests
(``Store(url, clock=FakeClock())``) that moves only when advanced.
"""

from agentkv.testing.clock import FakeClock
from agentkv.testing.engine_guard import RealEngineForbidden, forbid_real_engines
from agentkv.testing.fake_kv import FakeSlot
from agentkv.testing.scripted import ScriptedCall, ScriptedEngine, ScriptedReply
from agentkv.testing.session import ScriptedSession
from agentkv.testing.tokenizer import ScriptedTokenizer

__all__ = ["FakeClock", "FakeSlot", "RealEngineForbidden", "ScriptedCall", "ScriptedEngine", "ScriptedSession",
           "ScriptedTokenizer", "ScriptedReply", "forbid_real_engines"]
