"""``agentkv serve`` for the docs' client blocks: the app on the docs' stand-in model, served by
uvicorn on a free loopback port in a thread, so blocks written against a running server
(``# needs: agentkv serve --port 8000 --api-key sk-local``) run against this one::

    with serving_stand_in(tmp_path / "served.db") as url:
        blocks = [served_by(block, url) for block in python_blocks(page)]
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import uvicorn
from _doc_blocks import Block
from _doc_model import REPLIES_PER_ENGINE, reply

from agentkv.memory import Store
from agentkv.server import create_app
from agentkv.testing import ScriptedEngine

SERVED = "agentkv serve --port 8000 --api-key sk-local"
"""What a served block needs, word for word: the server these helpers provide."""
DOCS_URL = "http://127.0.0.1:8000"
API_KEY = "sk-local"
START_TIMEOUT_S = 30.0


@contextmanager
def serving_stand_in(db: Path) -> Iterator[str]:
    """The app (key ``sk-local``, a SQLite store at ``db``) served until the ``with`` ends; its URL."""
    app = create_app(ScriptedEngine([reply] * REPLIES_PER_ENGINE), store=Store(f"sqlite:///{db}"),
                     api_key=API_KEY, model_id="stand-in")
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="docs-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the docs' server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(START_TIMEOUT_S)


def served_by(block: Block, url: str) -> Block:
    """``block`` pointed at ``url`` and marked runnable if all it needs is ``SERVED``; else itself."""
    if block.needs != SERVED:
        return block
    _, _, rest = block.code.partition("\n")
    return Block(block.path, block.line, f"# {SERVED}: served by the test\n" + rest.replace(DOCS_URL, url))
