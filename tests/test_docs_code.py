"""Every ```python block of README.md and docs/**/*.md runs, so the docs cannot rot (issue 48).

Each page's blocks run in order (``tests/_doc_blocks.py``) on the stand-in model of
``tests/_doc_model.py`` (a ``ScriptedEngine`` answering the guides' questions), with the real
runtime, store (SQLite in a temporary ``AGENTKV_HOME``) and server code. A block that needs
something says so on its first line (``# needs: ...``); one that needs ``agentkv serve --port 8000
--api-key sk-local`` runs against the app on the stand-in model, served on a free port
(``tests/_doc_server.py``); the few that need replicas or a library agentkv does not install are
the only ones not run. The README's quickstart also runs on the default model in
``tests/model/test_examples_model.py``."""

from __future__ import annotations

import re
from contextlib import ExitStack

import pytest

from _doc_blocks import NEEDS, ROOT, doc_pages, python_blocks, run_page
from _doc_model import scripted_open_engine
from _doc_server import SERVED, served_by, serving_stand_in


def runnable(page):
    """The page's blocks the tests run: those that need nothing, and those that need ``SERVED``."""
    return [block for block in python_blocks(page) if block.needs in (None, SERVED)]


PAGES = [page for page in doc_pages() if runnable(page)]
"""The pages with a block the tests run."""


@pytest.fixture
def docs_home(tmp_path, monkeypatch):
    """A fresh AGENTKV_HOME and working directory, no database or model from the environment."""
    for name in ("AGENTKV_DB_URL", "AGENTKV_SNAPSHOT_URL", "AGENTKV_MODEL", "AGENTKV_SELF_CHECK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AGENTKV_HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path / "home"


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_python_block_of_the_page_runs(page, docs_home, capsys):
    blocks = python_blocks(page)
    with ExitStack() as stack:
        if any(block.needs == SERVED for block in blocks):
            url = stack.enter_context(serving_stand_in(docs_home.parent / "served.db"))
            blocks = [served_by(block, url) for block in blocks]
        engines = stack.enter_context(scripted_open_engine())
        ran = run_page(blocks)
    assert len(ran) == len(runnable(page)) > 0
    assert engines and any(engine.calls for engine in engines) or page.name == "your-own-model.md"
    if any("print(" in block.code for block in ran):
        assert capsys.readouterr().out.strip()


def test_the_readme_and_every_guide_but_scaling_out_have_code_the_tests_run():
    run = {str(page.relative_to(ROOT)) for page in PAGES}
    guides = {str(page.relative_to(ROOT)) for page in (ROOT / "docs" / "guides").glob("*.md")}
    assert {"README.md", "docs/index.md", "docs/getting-started.md"} <= run
    assert guides - run == {"docs/guides/scaling-out.md"}   # its code needs replicas


def test_only_blocks_that_need_replicas_or_another_library_are_left_out_and_they_say_so():
    left_out = [block for page in doc_pages() for block in python_blocks(page) if block.needs not in (None, SERVED)]
    assert all("agentkv serve" in (block.needs or "") or "replicas" in (block.needs or "") for block in left_out), \
        [(block.where, block.needs) for block in left_out]
    assert len(left_out) <= 3, [block.where for block in left_out]
    marked_later = [block.where for page in doc_pages() for block in python_blocks(page)
                    if NEEDS in block.code and block.needs is None]
    assert marked_later == []   # the marker works on the first line only


def test_the_readmes_links_and_pictures_name_files_that_exist():
    """mkdocs --strict checks the site's links; the README is read on GitHub, outside the site."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    targets = [t.split("#", 1)[0] for t in re.findall(r"\]\(([^)\s]+)\)", text) if "://" not in t]
    missing = [t for t in targets if t and not (ROOT / t).is_file()]
    assert targets and missing == []
