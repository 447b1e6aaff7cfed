"""The documentation site renders in a real browser: headless Chromium opens the built site's home page,
a guide and an API reference page, served on loopback, and each shows its content and navigation.

Marked ``docs`` (not in ``make test``): ``make docs-test`` and ``.ci/run`` run it after ``make docs``.
It uses the site in ``$AGENTKV_DOCS_SITE`` (``make docs-test`` passes ``site/``), else builds one with
``mkdocs build --strict`` into a temporary directory. Chromium is Debian's package
(``scripts/install_chromium.sh`` installs it); the screenshots are saved under a temporary directory
whose path the test prints, for CI to keep as artefacts.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM_TIMEOUT_S = 90
ACTIVE_TAB = re.compile(r'md-tabs__item--active">\s*<a [^>]*>\s*([^<]*?)\s*</a>')
"""The current tab's label in Material's header (whitespace around it is the theme's)."""


def chromium_binary() -> str:
    """Debian's chromium, or a failure saying how to install it."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        pytest.fail("chromium is not installed: run `bash scripts/install_chromium.sh` (apt-get, as root)")
    return found


@pytest.fixture(scope="module")
def site() -> Iterator[Path]:
    """The built site: $AGENTKV_DOCS_SITE, or a strict build into a temporary directory."""
    given = os.environ.get("AGENTKV_DOCS_SITE")
    if given:
        path = Path(given).resolve()
        assert (path / "index.html").is_file(), f"{path} holds no built site: run `make docs` first"
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="agentkv-site-") as built:
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", built],
                       cwd=ROOT, check=True, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
        yield Path(built)


@pytest.fixture(scope="module")
def served(site: Path) -> Iterator[str]:
    """The site served over HTTP on a free loopback port (as a reader's browser would load it)."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    """Serves files without logging each request to stderr."""

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def screenshots() -> Path:
    """Where the screenshots go: a temporary directory kept after the run, its path printed."""
    path = Path(tempfile.mkdtemp(prefix="agentkv-docs-screenshots-"))
    print(f"\ndocs screenshots: {path}")
    return path


def open_in_chromium(url: str, screenshot: Path) -> str:
    """The page's DOM after its scripts ran, and a screenshot of its first screen."""
    binary = chromium_binary()
    with tempfile.TemporaryDirectory(prefix="agentkv-chromium-") as profile:
        common = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                  "--hide-scrollbars", "--no-first-run", f"--user-data-dir={profile}",
                  "--window-size=1280,900", "--virtual-time-budget=5000"]
        dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                             timeout=CHROMIUM_TIMEOUT_S, check=True).stdout
        subprocess.run([*common, f"--screenshot={screenshot}", url], capture_output=True,
                       timeout=CHROMIUM_TIMEOUT_S, check=True)
    assert screenshot.is_file() and screenshot.stat().st_size > 10_000, f"no screenshot of {url}"
    return dom


def assert_has_navigation(dom: str, current_tab: str) -> None:
    """The site's header, its tabs with the current one marked, the side navigation and the search box."""
    assert 'class="md-header' in dom, "no header"
    assert 'class="md-tabs' in dom, "no navigation tabs"
    for tab in ("Getting started", "Guides", "API reference", "Benchmarks", "Design", "Changelog"):
        assert tab in dom, f"no {tab!r} tab"
    active = ACTIVE_TAB.search(dom)
    assert active is not None and active.group(1) == current_tab, f"current tab {active and active.group(1)!r}"
    assert 'class="md-nav' in dom, "no side navigation"
    assert 'class="md-search' in dom, "no search box"


def test_the_home_page_renders_with_its_navigation(served, screenshots):
    dom = open_in_chromium(f"{served}/", screenshots / "home.png")
    assert "<h1" in dom and "agentkv" in dom
    assert_has_navigation(dom, "Home")
    assert 'href="getting-started/"' in dom or 'href="getting-started/index.html"' in dom


def test_a_guide_renders_with_its_navigation_and_highlighted_code(served, screenshots):
    dom = open_in_chromium(f"{served}/guides/conversations/", screenshots / "guide-conversations.png")
    assert "<h1" in dom
    assert_has_navigation(dom, "Guides")
    for guide in ("Agents and tools", "Context policies", "Scaling out"):
        assert guide in dom, f"the guides' navigation lacks {guide!r}"
    assert 'class="highlight' in dom, "no highlighted code block in the guide"


def test_an_api_reference_page_renders_the_docstrings_of_runtime(served, screenshots):
    dom = open_in_chromium(f"{served}/reference/runtime/", screenshots / "reference-runtime.png")
    assert_has_navigation(dom, "API reference")
    assert 'id="agentkv.Runtime"' in dom, "no Runtime heading from mkdocstrings"
    assert 'id="agentkv.Runtime.open_conversation"' in dom, "no open_conversation entry"
    assert 'class="doc doc-' in dom, "no mkdocstrings content"
