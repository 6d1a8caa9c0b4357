# Two commands set up a fresh machine from nothing: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: 2.13.0 is the CPU wheel on this project's machines; a looser pin pulls CUDA builds.
TORCH ?= torch==2.13.0

.PHONY: demo test clean

$(VENV)/.dev: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

$(VENV)/.demo: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[demo]"
	touch $@

demo: $(VENV)/.demo
	$(VENV)/bin/hf-wide demo

test: $(VENV)/.dev
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info
