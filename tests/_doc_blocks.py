"""The ```python blocks of README.md and docs/**/*.md, and how one page's blocks run.

A page's blocks run in order, like a notebook: the snippets (top-level ``await`` allowed) share one
namespace and one event loop; a script (a block that calls ``anyio.run``) runs alone, outside any
loop. A block whose first line is ``# needs: ...`` says what it needs (a running server) and is
not run::

    for block in python_blocks(ROOT / "docs/guides/conversations.md"):
        print(block.where, block.needs or "runs")
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[1]
NEEDS = "# needs:"
"""The visible marker of a block the tests do not run: ``# needs: agentkv serve --port 8000``."""
_FENCE = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


@dataclass(frozen=True)
class Block:
    """One ```python block: its page, the line its code starts on, its code."""

    path: Path
    line: int
    code: str

    @property
    def where(self) -> str:
        """``docs/guides/server.md:42``: where to look when it fails."""
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def needs(self) -> str | None:
        """What the block needs to run, from its ``# needs:`` first line; None: the tests run it."""
        first = self.code.lstrip().split("\n", 1)[0]
        return first[len(NEEDS):].strip() if first.startswith(NEEDS) else None

    @property
    def is_script(self) -> bool:
        """A whole program (it starts its own event loop with ``anyio.run``)."""
        return "anyio.run(" in self.code


def doc_pages() -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks(path: Path) -> list[Block]:
    """The ```python blocks of one page."""
    text = path.read_text(encoding="utf-8")
    return [Block(path, text.count("\n", 0, match.start(1)) + 1, match.group(1)) for match in _FENCE.finditer(text)]


def doc_block(path: Path, containing: str) -> Block:
    """The one ```python block of ``path`` that contains ``containing``."""
    blocks = [block for block in python_blocks(path) if containing in block.code]
    assert len(blocks) == 1, f"{len(blocks)} blocks of {path.name} contain {containing!r}"
    return blocks[0]


async def run_snippet(block: Block, namespace: dict[str, Any]) -> None:
    """Run one block in ``namespace``, awaiting its top-level ``await``s."""
    code = compile(block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    outcome = eval(code, namespace)  # noqa: S307 - the docs' own code, run as the reader would
    if inspect.iscoroutine(outcome):
        await outcome


def run_page(blocks: Iterable[Block]) -> list[Block]:
    """Run a page's blocks that need nothing: scripts alone, then the snippets in one namespace and
    one event loop; the blocks run, in the order they ran. A failing block's error names it."""
    runnable = [block for block in blocks if block.needs is None]
    for script in (block for block in runnable if block.is_script):
        _named(script, lambda script=script: exec(compile(script.code, script.where, "exec"),
                                                   {"__name__": "__main__"}))
    snippets = [block for block in runnable if not block.is_script]

    async def all_snippets() -> None:
        namespace: dict[str, Any] = {"__name__": "__docs__"}
        for block in snippets:
            try:
                await run_snippet(block, namespace)
            except Exception as error:
                raise AssertionError(f"{block.where} failed: {error!r}") from error

    if snippets:
        anyio.run(all_snippets)
    return [block for block in runnable if block.is_script] + snippets


def _named(block: Block, run: Any) -> None:
    try:
        run()
    except Exception as error:
        raise AssertionError(f"{block.where} failed: {error!r}") from error
