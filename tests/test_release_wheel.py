"""The release installs and runs from its wheel alone: the wheel and the sdist build, and the wheel,
installed into a fresh venv with no editable agentkv and no repository on the path, runs
``agentkv --help`` and a five-line script on the default model.

Marked ``release`` (not in ``make test``): ``make release-test`` and ``.ci/run`` run it. The build
runs on a clean copy of the files a clone has (no stale ``build/`` or ``*.egg-info`` of the work
tree can leak in) with ``python -m build --no-isolation`` (setuptools and build are in the dev
extra: no download per build): the sdist first, then the wheel from the sdist. The fresh venv sees
the dependencies through a ``.pth`` line naming this environment's site-packages directory — a
plain path entry, so the ``.pth`` files there (the editable agentkv's finder among them) are not
run — and the test checks that ``agentkv`` is imported from the venv's own copy. The default model
comes from the user cache that ``make model`` fills.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.release

ROOT = Path(__file__).resolve().parents[1]
FIVE_LINES = """\
import anyio; from agentkv import Agent, GenerationConfig, Runtime, open_engine
async def main():
    runtime = Runtime(open_engine()); agent = Agent(name="hello", generation=GenerationConfig(max_new_tokens=8))
    print((await runtime.run(await runtime.open_conversation(agent), "Say hello.")).final_text); await runtime.aclose()
anyio.run(main)
"""
"""Five lines a user would write after `pip install agentkv`: the default model, one short answer."""
SOURCE_FILES = ("pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md")
"""What the build reads besides the package (pyproject names the readme and the license file)."""


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel and the sdist of the work tree, built into a temporary directory."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    for name in SOURCE_FILES:
        shutil.copy2(ROOT / name, source / name)
    shutil.copytree(ROOT / "agentkv", source / "agentkv", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                           capture_output=True, text=True, cwd=source)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def installed(dist: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel installed (no dependencies: they come from this environment)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    target = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                            check=True, capture_output=True, text=True).stdout.strip()
    Path(target, "agentkv_release_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (wheel,) = dist.glob("agentkv-*.whl")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, text=True)
    return venv


def run_in(venv: Path, *command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A command of the venv, from a directory outside the repository, with no PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(command), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_wheel_and_the_sdist_carry_the_package_its_types_and_its_license(dist):
    (wheel,) = dist.glob("agentkv-0.2.0-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "agentkv/py.typed" in names and "agentkv/runtime/runtime.py" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names[-8:]
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-Expression: Apache-2.0" in metadata and "Classifier: Typing :: Typed" in metadata
    (sdist,) = dist.glob("agentkv-0.2.0.tar.gz")
    members = tarfile.open(sdist).getnames()
    for needed in ("LICENSE", "README.md", "pyproject.toml", "agentkv/py.typed"):
        assert f"agentkv-0.2.0/{needed}" in members, needed


def test_the_installed_wheel_runs_the_cli_and_a_five_line_script_on_the_default_model(installed, tmp_path):
    helped = run_in(installed, str(installed / "bin" / "agentkv"), "--help", cwd=tmp_path)
    assert helped.returncode == 0, helped.stderr
    assert "conversations" in helped.stdout and "serve" in helped.stdout
    found = run_in(installed, str(installed / "bin" / "python"), "-c", "import agentkv; print(agentkv.__file__)",
                   cwd=tmp_path)
    imported_from = Path(found.stdout.strip())
    assert imported_from.is_relative_to(installed), f"agentkv came from {imported_from}, not the venv: {found.stderr}"
    script = tmp_path / "five_lines.py"
    script.write_text(FIVE_LINES, encoding="utf-8")
    assert len(FIVE_LINES.splitlines()) == 5
    ran = run_in(installed, str(installed / "bin" / "python"), str(script), cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.strip(), f"no answer printed: {ran.stderr[-2000:]}"
